"""Megatron-LM's argument rules (MEG001-MEG044) as data and small checks over :class:`MegatronArgs`.

:func:`check_megatron_args` applies Megatron's rules (``validate_args`` in
megatron/training/arguments.py, ``TransformerConfig.__post_init__``, the microbatch
calculator and the interleaved schedule of megatron-core core_v0.16.1) and returns
:class:`Finding` records with stable rule ids (:data:`RULES`). In core_v0.16.1 point-to-point
overlap in the interleaved schedule is on by default (``--no-overlap-p2p-communication`` turns
it off); there is no ``--overlap-p2p-communication`` flag.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from planner.engines.megatron.flags import MEGATRON_VERSION, RECOMPUTE_MODULES, Flag, FlagSpec, MegatronArgs, as_float, as_int, flag_table
from planner.engines.megatron.layout import LayoutError, parse_layout, virtual_size
from planner.engines.megatron.moe import parse_layer_freq
from planner.errors import close_matches
from planner.solve.mesh import cp_comm_problems

#: flags pretrain_gpt.py cannot run without (num-layers, hidden-size, heads and max positions are asserted by
#: validate_args; the sequence length and batch sizes define the run)
REQUIRED_FLAGS = (
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--seq-length",
    "--max-position-embeddings",
    "--micro-batch-size",
    "--global-batch-size",
)

#: rule id -> (severity, one-line title)
RULES: dict[str, tuple[str, str]] = {
    "MEG001": ("error", "a required flag is missing"),
    "MEG002": ("error", "world size not divisible by tp x pp x cp"),
    "MEG003": ("error", "even layer split: layers not divisible over the pipeline (and virtual) stages"),
    "MEG004": ("error", "uneven first/last pipeline stage arithmetic"),
    "MEG005": ("error", "uneven first/last stage flags combined with --account-for-*-in-pipeline-split"),
    "MEG006": ("error", "--pipeline-model-parallel-layout is malformed"),
    "MEG007": ("error", "--pipeline-model-parallel-layout layer counts do not match the model"),
    "MEG008": ("error", "--pipeline-model-parallel-layout: E must appear once, first in the first stage"),
    "MEG009": ("error", "--pipeline-model-parallel-layout: L must appear once, last in the last stage"),
    "MEG010": ("error", "--pipeline-model-parallel-layout: stage count not a multiple of pp"),
    "MEG011": ("error", "--pipeline-model-parallel-layout combined with other split or virtual-stage flags"),
    "MEG012": ("error", "conflicting virtual pipeline flags"),
    "MEG013": ("error", "attention heads not divisible by tp"),
    "MEG014": ("error", "query groups incompatible with tp or heads"),
    "MEG015": ("error", "global batch not divisible by micro batch x dp"),
    "MEG016": ("error", "interleaved schedule: micro-batch count does not fit the pipeline"),
    "MEG017": ("error", "interleaved schedule: pipeline too shallow"),
    "MEG018": ("warning", "--sequence-parallel with tp = 1 is silently dropped"),
    "MEG019": ("error", "--overlap-param-gather needs the distributed optimizer and --overlap-grad-reduce"),
    "MEG020": ("error", "activation recomputation flags do not combine"),
    "MEG021": ("error", "sequence length not a multiple of 2 x cp"),
    "MEG022": ("error", "CUDA_DEVICE_MAX_CONNECTIONS=1 not exported with tp > 1 or cp > 1"),
    "MEG023": ("error", "hidden size not divisible by attention heads"),
    "MEG024": ("error", "max position embeddings shorter than the sequence"),
    "MEG025": ("error", "--fp16 and --bf16 together"),
    "MEG026": ("warning", "--num-query-groups without --group-query-attention is ignored"),
    "MEG027": ("error", "a flag's value is missing or has the wrong type"),
    "MEG028": ("error", "not a Megatron-LM flag, or a stray word"),
    "MEG029": ("warning", "a flag is given twice with different values (the last wins)"),
    "MEG030": ("error", "FFN hidden size not divisible by tp (routed experts': by etp)"),
    "MEG031": ("error", "the launch script did not reach its launch (it failed, looped or ran past its limits)"),
    "MEG032": ("error", "world size not divisible by etp x ep x pp (the expert-parallel grid)"),
    "MEG033": ("error", "expert parallelism without --num-experts, or experts not divisible by ep"),
    "MEG034": ("error", "--moe-router-topk outside 1 ... --num-experts"),
    "MEG035": ("error", "--moe-layer-freq is not a pattern Megatron reads, or not one entry per layer"),
    "MEG036": ("error", "router flags TransformerConfig refuses"),
    "MEG037": ("error", "token dispatcher flags that do not combine"),
    "MEG038": ("error", "biases in MoE layers with expert tensor parallelism"),
    "MEG039": ("warning", "expert and tensor parallelism without --sequence-parallel"),
    "MEG040": ("error", "multi-latent attention flags megatron-core refuses"),
    "MEG041": ("error", "--fp8-param-gather without FP8 training or without the distributed optimizer"),
    "MEG042": ("error", "--overlap-moe-expert-parallel-comm without what TransformerConfig asserts for it"),
    "MEG043": ("error", "MLP activation flags that do not combine (squared ReLU with SwiGLU, or with the bias-GeLU fusion)"),
    "MEG044": ("error", "--cp-comm-type values Transformer Engine cannot run with these flags"),
}

#: Transformer Engine's context-parallel exchanges (DotProductAttention cp_comm_type; Megatron passes the value through)
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


#: flags whose value is a size or count Megatron-LM divides by or allocates: 0 or less divides by zero or builds nothing
#: in arguments.py validate_args and the model (core_v0.16.1); beyond MAX_SIZE no run exists
POSITIVE_SIZES = frozenset(
    {
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
        "--context-parallel-size",
        "--expert-model-parallel-size",
        "--expert-tensor-parallel-size",
        "--num-layers",
        "--hidden-size",
        "--ffn-hidden-size",
        "--num-attention-heads",
        "--num-query-groups",
        "--kv-channels",
        "--seq-length",
        "--max-position-embeddings",
        "--micro-batch-size",
        "--global-batch-size",
        "--vocab-size",
        "--num-experts",
        "--moe-router-topk",
        "--moe-ffn-hidden-size",
        "--num-virtual-stages-per-pipeline-rank",
        "--num-layers-per-virtual-pipeline-stage",
        "--microbatch-group-size-per-virtual-pipeline-stage",
    }
)
MAX_SIZE = 2**31


@dataclass(frozen=True)
class Finding:
    """One rule violation: which rule, how bad, where, what, and how to fix it."""

    rule: str
    severity: Literal["error", "warning"]
    line: int | None
    message: str
    fix: str

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"{self.rule} {self.severity}: {where}{self.message} Fix: {self.fix}"


class _Checker:
    def __init__(self, args: MegatronArgs, world_size: int | None):
        self.a = args
        self.world = world_size if world_size is not None else args.world_size
        self.out: list[Finding] = []

    def add(self, rule: str, line: int | None, message: str, fix: str) -> None:
        self.out.append(Finding(rule, RULES[rule][0], line, message, fix))  # type: ignore[arg-type]

    def line(self, *names: str) -> int | None:
        for n in names:
            ln = self.a.line(n)
            if ln is not None:
                return ln
        return self.a.launch_line

    def run(self) -> list[Finding]:
        a = self.a
        if a.stopped is not None:
            self.add(
                "MEG031",
                a.launch_line,
                a.stopped,
                "make the script reach its launch when run as `bash SCRIPT` with no arguments (planner validate runs it with stub launchers)",
            )
            if a.script is None:
                return self.finish()  # no launch captured: there are no flags to check
        self.flag_syntax()
        for name in REQUIRED_FLAGS:
            if not a.has(name):
                self.add("MEG001", a.launch_line, f"{name} is not given; pretrain_gpt.py needs it.", f"add {name} N to the launch arguments")
        tp = a.int("--tensor-model-parallel-size", 1)
        pp = a.int("--pipeline-model-parallel-size", 1)
        cp = a.int("--context-parallel-size", 1)
        if tp is None or pp is None or cp is None or tp < 1 or pp < 1 or cp < 1:
            return self.finish()  # MEG027 says which
        L = a.int("--num-layers")
        dp = None
        if self.world is not None:
            model = tp * pp * cp
            if self.world % model:
                self.add(
                    "MEG002",
                    self.line("--tensor-model-parallel-size", "--pipeline-model-parallel-size"),
                    f"world size {self.world} is not divisible by tp x pp x cp = {tp} x {pp} x {cp} = {model}.",
                    f"use a world size that is a multiple of {model}, or change the parallel sizes",
                )
            else:
                dp = self.world // model
        if L is not None:
            self.split_rules(L, pp)
        self.attention_rules(tp)
        self.batch_rules(tp, pp, dp, L)
        self.misc_rules(tp, cp)
        self.moe_rules(tp, pp, L, dp)
        self.mla_rules()
        return self.finish()

    def finish(self) -> list[Finding]:
        order = {r: k for k, r in enumerate(RULES)}
        return sorted(self.out, key=lambda f: (order[f.rule], f.line or 0, f.message))

    # flag syntax ------------------------------------------------------------
    def flag_syntax(self) -> None:
        table = flag_table()
        for p in self.a.problems:
            self.add("MEG027", p.line, f"argparse refuses {p.name}: {p.value}.", f"give {p.name} the values it takes")
        for p in self.a.positionals:
            self.add(
                "MEG028",
                p.line,
                f"{p.name!r} is neither a flag nor the value of one (the flag before it takes no more values); pretrain_gpt.py stops with 'unrecognized arguments'.",
                "remove it, or give it the flag it belongs to",
            )
        seen: dict[str, Flag] = {}
        for f in self.a.flags:
            spec = table.get(f.name)
            if spec is None and not table:
                continue
            if spec is None:
                hint = close_matches(f.name.replace("_", "-"), table)
                alt = {
                    "--overlap-p2p-communication": "point-to-point overlap is on by default in core_v0.16.1 (turn it off with --no-overlap-p2p-communication); remove the flag"
                }
                fix = alt.get(f.name) or (
                    f"did you mean {' or '.join(hint)}?" if hint else "remove it, or check the spelling against Megatron-LM's arguments.py"
                )
                self.add(
                    "MEG028", f.line, f"{f.name} is not a flag of Megatron-LM {MEGATRON_VERSION}; pretrain_gpt.py stops with 'unrecognized arguments'.", fix
                )
                continue
            self._check_values(f, spec)
            prev = seen.get(f.name)
            if prev is not None and prev.values != f.values:
                self.add(
                    "MEG029",
                    f.line,
                    f"{f.name} is given on line {prev.line} ({' '.join(prev.values) or 'switch'}) and again here ({' '.join(f.values) or 'switch'}); argparse keeps the last.",
                    "keep one of them",
                )
            seen[f.name] = f

    def _check_values(self, f: Flag, spec: FlagSpec) -> None:
        n = len(f.values)
        size = as_int(f.values[0]) if f.name in POSITIVE_SIZES and n == 1 else None
        if size is not None and not 1 <= size <= MAX_SIZE:
            self.add(
                "MEG027",
                f.line,
                f"{f.name} is {f.values[0][:40]}; it must be a whole number from 1 to {MAX_SIZE:,} (Megatron-LM divides by it or builds that many).",
                f"give {f.name} a positive size",
            )
            return
        if spec.nargs == "0":
            return  # extra words after a switch are positional arguments; argparse rejects them but they are rare
        want = {"1": (1, 1), "3": (3, 3), "+": (1, None), "*": (0, None)}[spec.nargs]
        if n < want[0] or (want[1] is not None and n > want[1]):
            self.add("MEG027", f.line, f"{f.name} takes {spec.nargs if spec.nargs != '+' else 'one or more'} value(s), got {n}.", f"give {f.name} its value")
            return
        conv = {"int": as_int, "float": as_float}.get(spec.type)
        if conv is not None:
            for v in f.values:
                if conv(v) is None:
                    self.add(
                        "MEG027",
                        f.line,
                        f"{f.name} expects {'an integer' if spec.type == 'int' else 'a number'}, got {v!r}.",
                        f"give {f.name} a {spec.type} value",
                    )

    # layer split --------------------------------------------------------------
    def split_rules(self, L: int, pp: int) -> None:
        a = self.a
        layout = a.value("--pipeline-model-parallel-layout")
        first = a.int("--decoder-first-pipeline-num-layers")
        last = a.int("--decoder-last-pipeline-num-layers")
        uneven = a.has("--decoder-first-pipeline-num-layers") or a.has("--decoder-last-pipeline-num-layers")
        emb = a.has("--account-for-embedding-in-pipeline-split")
        loss = a.has("--account-for-loss-in-pipeline-split")
        nlpvs = a.int("--num-layers-per-virtual-pipeline-stage")
        nvs = a.int("--num-virtual-stages-per-pipeline-rank")
        if a.has("--num-layers-per-virtual-pipeline-stage") and a.has("--num-virtual-stages-per-pipeline-rank"):
            self.add(
                "MEG012",
                self.line("--num-virtual-stages-per-pipeline-rank"),
                "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are both given; validate_args allows at most one.",
                "keep --num-virtual-stages-per-pipeline-rank",
            )
        if layout is not None:
            self.layout_rules(layout, L, pp, uneven, emb, loss)
            return
        if uneven:
            if a.has("--num-layers-per-virtual-pipeline-stage") and not a.has("--num-virtual-stages-per-pipeline-rank"):
                self.add(
                    "MEG012",
                    self.line("--num-layers-per-virtual-pipeline-stage"),
                    "uneven first/last stages with --num-layers-per-virtual-pipeline-stage: validate_args requires --num-virtual-stages-per-pipeline-rank instead.",
                    "replace it with --num-virtual-stages-per-pipeline-rank V",
                )
            if emb or loss:
                self.add(
                    "MEG005",
                    self.line("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"),
                    "--decoder-first/last-pipeline-num-layers cannot be combined with --account-for-embedding/loss-in-pipeline-split (TransformerConfig raises ValueError).",
                    "drop the account-for flags (the first/last counts already make room), or use an even split",
                )
            self.uneven_rules(L, pp, first, last, nvs)
            return
        total = L + emb + loss
        extra = " (counting the embedding and/or loss as a layer each)" if emb or loss else ""
        if total % pp:
            self.add(
                "MEG003",
                self.line("--num-layers", "--pipeline-model-parallel-size"),
                f"{total} layers{extra} do not divide over pp = {pp} ({total} = {total // pp} x {pp} + {total % pp}).",
                "choose pp dividing the layer count, or give --decoder-first/last-pipeline-num-layers or --pipeline-model-parallel-layout",
            )
            return
        per_rank = total // pp
        if nlpvs is not None and not a.has("--num-virtual-stages-per-pipeline-rank"):
            if nlpvs < 1 or per_rank % nlpvs:
                self.add(
                    "MEG003",
                    self.line("--num-layers-per-virtual-pipeline-stage"),
                    f"{per_rank} layers per pipeline rank are not divisible by --num-layers-per-virtual-pipeline-stage {nlpvs}.",
                    "pick a value dividing the layers per rank",
                )
        elif nvs is not None and nvs > 1 and per_rank % nvs:
            self.add(
                "MEG003",
                self.line("--num-virtual-stages-per-pipeline-rank"),
                f"{per_rank} layers per pipeline rank{extra} do not divide into {nvs} virtual stages (get_num_layers_to_build asserts it).",
                f"pick a virtual size dividing {per_rank}, or give --pipeline-model-parallel-layout",
            )

    def uneven_rules(self, L: int, pp: int, first: int | None, last: int | None, nvs: int | None) -> None:
        a = self.a
        vp = nvs if nvs is not None and nvs > 1 else None
        rest, left = L, pp
        for name, val in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
            if not a.has(name) or val is None:
                continue
            if val <= 0:
                self.add("MEG004", a.line(name), f"{name} is {val}; it must be larger than 0.", "give at least one layer, or drop the flag")
            elif vp and val % vp:
                self.add("MEG004", a.line(name), f"{name} {val} is not divisible by the virtual size {vp}.", f"use a multiple of {vp}")
            rest -= val
            left -= 1
        ln = self.line("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")
        if left < 0:
            self.add("MEG004", ln, f"first and last stage counts need pp >= 2, got pp = {pp}.", "drop one of the flags")
        elif bool(rest) != bool(left):
            self.add(
                "MEG004",
                ln,
                f"{rest} middle layers remain for {left} middle pipeline stages (num_layers {L}, pp {pp}).",
                "make the first/last counts add up with the middle stages",
            )
        elif left and rest % left:
            self.add(
                "MEG004",
                ln,
                f"{rest} middle layers do not divide over the {left} middle pipeline stages ({rest} = {rest // left} x {left} + {rest % left}).",
                "adjust the first/last counts so the middle layers divide evenly, or use --pipeline-model-parallel-layout",
            )
        elif left and vp and (rest // left) % vp:
            self.add(
                "MEG004",
                ln,
                f"{rest // left} layers per middle pipeline rank are not divisible by the virtual size {vp}.",
                "adjust the counts, or use --pipeline-model-parallel-layout",
            )

    def layout_rules(self, layout: str, L: int, pp: int, uneven: bool, emb: bool, loss: bool) -> None:
        a = self.a
        ln = a.line("--pipeline-model-parallel-layout")
        conflicts = [
            n
            for n, present in (
                ("--decoder-first-pipeline-num-layers", a.has("--decoder-first-pipeline-num-layers")),
                ("--decoder-last-pipeline-num-layers", a.has("--decoder-last-pipeline-num-layers")),
                ("--account-for-embedding-in-pipeline-split", emb),
                ("--account-for-loss-in-pipeline-split", loss),
                ("--num-layers-per-virtual-pipeline-stage", a.has("--num-layers-per-virtual-pipeline-stage")),
                ("--num-virtual-stages-per-pipeline-rank", a.has("--num-virtual-stages-per-pipeline-rank")),
            )
            if present
        ]
        if conflicts:
            self.add(
                "MEG011",
                ln,
                f"--pipeline-model-parallel-layout cannot be combined with {', '.join(conflicts)} (validate_args / TransformerConfig refuse it).",
                "the layout already fixes every stage and the virtual size: drop the other flags",
            )
        try:
            stages = parse_layout(layout)
        except LayoutError as e:
            self.add("MEG006", ln, str(e) + ".", "fix the layout string, e.g. 'Et*3|(t*4|)*6,t*3L'")
            return
        if len(stages) % pp:
            self.add(
                "MEG010",
                ln,
                f"the layout has {len(stages)} stages, not a multiple of pp = {pp} (stage i runs on rank i % pp).",
                f"write pp x vp stages, e.g. {pp} or {2 * pp}",
            )
        flat = [c for st in stages for c in st]
        nt = flat.count("t")
        if nt != L:
            self.add("MEG007", ln, f"the layout places {nt} decoder layers (t) but --num-layers is {L}.", f"make the t count {L}")
        mtp = a.int("--mtp-num-layers") or 0
        nm = flat.count("m")
        if nm != mtp:
            self.add("MEG007", ln, f"the layout places {nm} MTP layers (m) but --mtp-num-layers is {mtp}.", "match the m count to --mtp-num-layers")
        if flat.count("E") != 1 or not stages[0] or stages[0][0] != "E":
            where = [i for i, st in enumerate(stages) if "E" in st]
            self.add(
                "MEG008",
                ln,
                f"E appears {flat.count('E')} time(s) (stages {where}); it must appear once, first in the first stage (Megatron builds the embedding on stage 0).",
                "start the layout with E",
            )
        if flat.count("L") != 1 or not stages[-1] or stages[-1][-1] != "L":
            where = [i for i, st in enumerate(stages) if "L" in st]
            self.add(
                "MEG009",
                ln,
                f"L appears {flat.count('L')} time(s) (stages {where}); it must appear once, last in the last stage (Megatron computes the loss on the last stage).",
                "end the layout with L",
            )

    # attention ----------------------------------------------------------------
    def attention_rules(self, tp: int) -> None:
        a = self.a
        heads = a.int("--num-attention-heads")
        hidden = a.int("--hidden-size")
        if heads is not None and heads > 0 and heads % tp:
            self.add(
                "MEG013",
                self.line("--num-attention-heads", "--tensor-model-parallel-size"),
                f"{heads} attention heads are not divisible by tp = {tp} (TransformerConfig raises ValueError).",
                "choose tp dividing the head count",
            )
        if a.has("--group-query-attention"):
            groups = a.int("--num-query-groups", 1)
            if groups is not None and groups > 0:
                if groups % tp and tp % groups:
                    self.add(
                        "MEG014",
                        self.line("--num-query-groups"),
                        f"{groups} query groups are neither a multiple nor a divisor of tp = {tp} (TransformerConfig raises ValueError).",
                        "choose tp dividing the query groups, or a multiple of them",
                    )
                if heads and heads % groups:
                    self.add(
                        "MEG014",
                        self.line("--num-query-groups"),
                        f"{heads} attention heads are not a multiple of {groups} query groups.",
                        "use a query group count that divides the heads",
                    )
        elif a.has("--num-query-groups"):
            self.add(
                "MEG026",
                a.line("--num-query-groups"),
                f"--num-query-groups {a.value('--num-query-groups')} has no effect without --group-query-attention: Megatron builds {heads or 'all'} key/value heads (multi-head attention).",
                "add --group-query-attention",
            )
        if heads and hidden and not a.has("--kv-channels") and hidden % heads:
            self.add(
                "MEG023",
                self.line("--hidden-size"),
                f"hidden size {hidden} is not divisible by {heads} attention heads (validate_args asserts it).",
                "give --kv-channels, or fix the sizes",
            )
        ffn = a.int("--ffn-hidden-size")
        if ffn is not None and ffn > 0 and ffn % tp:
            self.add(
                "MEG030",
                self.line("--ffn-hidden-size"),
                f"FFN hidden size {ffn} is not divisible by tp = {tp} (the MLP's parallel linear layers assert it).",
                "choose tp dividing the FFN size",
            )
        if a.int("--num-experts"):  # routed experts split over etp (default tp), shared experts over tp (megatron-core experts.py, shared_experts.py)
            etp = a.int("--expert-tensor-parallel-size", tp)
            for flag, size, name in (("--moe-ffn-hidden-size", etp, "etp"), ("--moe-shared-expert-intermediate-size", tp, "tp")):
                width = a.int(flag)
                if width is not None and width > 0 and size is not None and size > 0 and width % size:
                    self.add(
                        "MEG030",
                        a.line(flag),
                        f"{flag} {width} is not divisible by {name} = {size} (the experts' parallel linear layers assert it).",
                        f"choose {name} dividing {width}",
                    )

    # batches and schedule -----------------------------------------------------
    def batch_rules(self, tp: int, pp: int, dp: int | None, L: int | None) -> None:
        a = self.a
        mb = a.int("--micro-batch-size")
        gb = a.int("--global-batch-size")
        m = None
        if mb is not None and gb is not None and dp is not None and mb > 0:
            if gb % (mb * dp):
                self.add(
                    "MEG015",
                    self.line("--global-batch-size"),
                    f"global batch {gb} is not divisible by micro batch {mb} x dp {dp} = {mb * dp} (the microbatch calculator asserts it).",
                    f"use a global batch that is a multiple of {mb * dp}",
                )
            else:
                m = gb // (mb * dp)
        vp = virtual_size(a, L or 0, pp)
        if not vp:
            return
        ln = self.line("--num-virtual-stages-per-pipeline-rank", "--pipeline-model-parallel-layout", "--num-layers-per-virtual-pipeline-stage")
        no_overlap = a.has("--no-overlap-p2p-communication")
        if pp <= 1 or (no_overlap and pp <= 2):
            need = "> 2 with --no-overlap-p2p-communication" if no_overlap else "> 1"
            self.add(
                "MEG017",
                ln,
                f"the interleaved schedule ({vp} virtual stages per rank) needs pp {need}, got pp = {pp} (validate_args asserts it).",
                "drop the virtual stages, or deepen the pipeline" + (", or drop --no-overlap-p2p-communication" if no_overlap and pp == 2 else ""),
            )
        if m is not None and dp is not None and pp > 1:  # m is set only when dp is
            group = a.int("--microbatch-group-size-per-virtual-pipeline-stage") or pp
            if group < pp or group > m:
                self.add(
                    "MEG016",
                    self.line("--global-batch-size", "--microbatch-group-size-per-virtual-pipeline-stage"),
                    f"the interleaved schedule runs micro-batches in groups of {group}, which must lie in [pp, micro-batches] = [{pp}, {m}] (global {gb} / (micro {mb} x dp {dp}) = {m} micro-batches).",
                    f"use at least {max(pp, group)} micro-batches per step (global batch >= {max(pp, group) * (mb or 1) * dp})",
                )
            elif 0 < m % group < pp:
                self.add(
                    "MEG016",
                    self.line("--global-batch-size"),
                    f"{m} micro-batches leave a last group of {m % group} < pp = {pp} (groups of {group}); the interleaved schedule raises RuntimeError (m must be a multiple of pp with the default group size).",
                    f"use a multiple of {group} micro-batches (global batch multiple of {group * (mb or 1) * dp})",
                )

    # misc -----------------------------------------------------------------------
    def misc_rules(self, tp: int, cp: int) -> None:
        a = self.a
        if a.has("--sequence-parallel") and tp == 1:
            self.add(
                "MEG018",
                a.line("--sequence-parallel"),
                "--sequence-parallel with tp = 1: validate_args turns it off (with a warning).",
                "drop --sequence-parallel, or use tp > 1",
            )
        if a.has("--overlap-param-gather"):
            missing = [n for n in ("--use-distributed-optimizer", "--overlap-grad-reduce") if not a.has(n)]
            if "--use-distributed-optimizer" in missing and a.has("--use-megatron-fsdp"):
                missing.remove("--use-distributed-optimizer")
            if missing:
                self.add(
                    "MEG019",
                    a.line("--overlap-param-gather"),
                    f"--overlap-param-gather needs {' and '.join(missing)} (validate_args asserts it).",
                    f"add {' '.join(missing)}",
                )
        if a.has("--fp8-param-gather"):
            # validate_args asserts the distributed optimizer (or an FSDP); TransformerConfig refuses fp8_param without fp8
            missing = [n for n in ("--fp8-format", "--use-distributed-optimizer") if not a.has(n)]
            if "--use-distributed-optimizer" in missing and (a.has("--use-megatron-fsdp") or a.has("--use-torch-fsdp2")):
                missing.remove("--use-distributed-optimizer")
            if missing:
                self.add(
                    "MEG041",
                    a.line("--fp8-param-gather"),
                    f"--fp8-param-gather needs {' and '.join(missing)} (validate_args and TransformerConfig assert it).",
                    f"add {' '.join(missing)}, or drop --fp8-param-gather",
                )
        self.recompute_rules()
        self.cp_comm_rules(cp, tp)
        seq = a.int("--seq-length")
        if cp > 1 and seq is not None and seq % (2 * cp):
            self.add(
                "MEG021",
                self.line("--seq-length", "--context-parallel-size"),
                f"sequence length {seq} is not a multiple of 2 x cp = {2 * cp}.",
                f"use a sequence length divisible by {2 * cp}",
            )
        if (tp > 1 or cp > 1) and a.kind == "script" and a.env_value("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
            val = a.env_value("CUDA_DEVICE_MAX_CONNECTIONS")
            now = f"it is exported as {val!r}" if val is not None else "it is not exported"
            self.add(
                "MEG022",
                a.launch_line,
                f"tp = {tp}, cp = {cp} need CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment; {now} (validate_args asserts it on GPUs before Blackwell).",
                "add `export CUDA_DEVICE_MAX_CONNECTIONS=1` before the launch",
            )
        heads_pos = a.int("--max-position-embeddings")
        if seq is not None and heads_pos is not None and heads_pos < seq:
            self.add(
                "MEG024",
                self.line("--max-position-embeddings"),
                f"--max-position-embeddings {heads_pos} is shorter than --seq-length {seq} (validate_args asserts >=).",
                f"set --max-position-embeddings to at least {seq}",
            )
        if a.has("--fp16") and a.has("--bf16"):
            self.add("MEG025", self.line("--fp16"), "--fp16 and --bf16 are both given; Megatron trains in one of them.", "keep one")
        if a.has("--squared-relu"):
            # core_transformer_config_from_args asserts not swiglu; TransformerConfig fuses only gelu / swiglu with a bias
            if a.has("--swiglu"):
                self.add(
                    "MEG043", self.line("--squared-relu"), "--squared-relu with --swiglu: core_transformer_config_from_args asserts one activation.", "keep one"
                )
            elif not a.has("--disable-bias-linear") and not a.has("--no-bias-gelu-fusion"):
                self.add(
                    "MEG043",
                    self.line("--squared-relu"),
                    "--squared-relu with biases and the bias-GeLU fusion on: TransformerConfig fuses only gelu and swiglu with their bias and raises.",
                    "add --no-bias-gelu-fusion (or --disable-bias-linear)",
                )

    # mixtures of experts and multi-latent attention ----------------------------
    def moe_rules(self, tp: int, pp: int, L: int | None, dp: int | None) -> None:
        """validate_args (arguments.py), parallel_state.initialize_model_parallel and TransformerConfig.__post_init__
        (megatron-core 0.16.1) on the MoE flags; ``dp`` is None when the world size is unknown or MEG002 fired."""
        a = self.a
        ep = a.int("--expert-model-parallel-size", 1)
        etp = a.int("--expert-tensor-parallel-size", tp)  # validate_args: unset means tp
        experts = a.int("--num-experts")
        experts = None if experts == 0 else experts  # validate_args: 0 means none
        if ep is None or etp is None or ep < 1 or etp < 1:
            return  # MEG027 says which
        grid = etp * ep * pp
        if dp is not None and self.world is not None and self.world % grid:  # dp None: MEG002 (raised first) or no world size
            self.add(
                "MEG032",
                self.line("--expert-model-parallel-size", "--expert-tensor-parallel-size"),
                f"world size {self.world} is not divisible by etp x ep x pp = {etp} x {ep} x {pp} = {grid} (parallel_state raises RuntimeError).",
                f"use a world size that is a multiple of {grid}, or change ep / etp",
            )
        if ep > 1 and experts is None:
            self.add(
                "MEG033",
                self.line("--expert-model-parallel-size"),
                f"--expert-model-parallel-size {ep} without --num-experts (validate_args asserts num_experts is set).",
                "add --num-experts N, or drop expert parallelism",
            )
        elif experts is not None and experts > 0 and experts % ep:
            self.add(
                "MEG033",
                self.line("--num-experts", "--expert-model-parallel-size"),
                f"{experts} experts are not divisible by ep = {ep} (validate_args asserts it).",
                "choose ep dividing the expert count",
            )
        if experts is None:
            if a.has("--overlap-moe-expert-parallel-comm"):
                self.ep_overlap_rules(ep, pp, L, a.value("--moe-token-dispatcher-type") or "allgather")
            return
        topk = a.int("--moe-router-topk", 2)  # TransformerConfig's default
        if topk is not None and not 1 <= topk <= experts:
            self.add(
                "MEG034",
                self.line("--moe-router-topk", "--num-experts"),
                f"--moe-router-topk {topk} routes each token to {topk} of {experts} experts (the router's top-k needs 1 <= k <= experts).",
                f"use a top-k between 1 and {experts}",
            )
        freq = a.value("--moe-layer-freq")
        if freq is not None:
            try:
                parsed = parse_layer_freq(freq)
            except ValueError as e:
                self.add(
                    "MEG035",
                    a.line("--moe-layer-freq"),
                    f"--moe-layer-freq {freq!r}: {e} (moe_freq_type).",
                    "write an int N or a pattern like '([0]*3+[1]*58)'",
                )
            else:
                if isinstance(parsed, int) and parsed < 1:
                    self.add("MEG035", a.line("--moe-layer-freq"), f"--moe-layer-freq {parsed} (every N-th layer needs N >= 1).", "use N >= 1")
                elif isinstance(parsed, list) and L is not None and (len(parsed) != L or any(x not in (0, 1) for x in parsed)):
                    self.add(
                        "MEG035",
                        a.line("--moe-layer-freq"),
                        f"--moe-layer-freq gives {len(parsed)} entries {sorted(set(parsed))} for {L} layers (get_gpt_decoder_layer_specs needs one 0/1 entry per layer).",
                        f"write {L} entries of 0 (dense) or 1 (MoE)",
                    )
        score = a.value("--moe-router-score-function") or "softmax"
        balance = a.get("--moe-router-load-balancing-type")
        balance_types = balance.values if balance is not None else ("aux_loss",)
        if a.has("--moe-router-enable-expert-bias") and score != "sigmoid":
            self.add(
                "MEG036",
                a.line("--moe-router-enable-expert-bias"),
                f"--moe-router-enable-expert-bias with score function {score!r} (TransformerConfig: expert bias needs sigmoid).",
                "add --moe-router-score-function sigmoid, or drop the expert bias",
            )
        if topk == 1 and score == "softmax" and not a.has("--moe-router-pre-softmax") and balance_types != ("sinkhorn",):
            self.add(
                "MEG036",
                self.line("--moe-router-topk"),
                "top-1 softmax routing without --moe-router-pre-softmax (TransformerConfig raises: softmax over one logit has zero gradient).",
                "add --moe-router-pre-softmax",
            )
        dispatcher = a.value("--moe-token-dispatcher-type") or "allgather"
        if dispatcher == "flex" and tp * ep <= 1:
            self.add(
                "MEG037",
                a.line("--moe-token-dispatcher-type"),
                f"the flex token dispatcher with tp x ep = {tp * ep} (MoEFlexTokenDispatcher asserts tp x ep > 1).",
                "use --moe-token-dispatcher-type alltoall",
            )
        if a.has("--moe-shared-expert-overlap") and a.has("--moe-shared-expert-intermediate-size") and dispatcher != "alltoall":
            self.add(
                "MEG037",
                a.line("--moe-shared-expert-overlap"),
                f"--moe-shared-expert-overlap with the {dispatcher} dispatcher (TransformerConfig: it works with alltoall only).",
                "add --moe-token-dispatcher-type alltoall, or drop the overlap",
            )
        if etp > 1 and not a.has("--disable-bias-linear"):
            self.add(
                "MEG038",
                self.line("--expert-tensor-parallel-size", "--tensor-model-parallel-size"),
                f"MoE layers with biases and expert tensor parallelism {etp} (TransformerConfig asserts etp == 1 with biases; --expert-tensor-parallel-size defaults to tp).",
                "add --disable-bias-linear, or --expert-tensor-parallel-size 1",
            )
        if a.has("--overlap-moe-expert-parallel-comm"):
            self.ep_overlap_rules(ep, pp, L, dispatcher)
        if ep > 1 and tp > 1 and not a.has("--sequence-parallel"):
            self.add(
                "MEG039",
                self.line("--expert-model-parallel-size"),
                f"ep = {ep} with tp = {tp} and no --sequence-parallel (ModelParallelConfig: sequence parallelism must be used with expert and tensor parallelism).",
                "add --sequence-parallel",
            )

    def ep_overlap_rules(self, ep: int, pp: int, L: int | None, dispatcher: str) -> None:
        """TransformerConfig.__post_init__ (megatron-core 0.16.1) on overlap_moe_expert_parallel_comm: expert parallelism,
        virtual pipeline stages when pp > 1, the alltoall or flex dispatcher, no full recomputation and no recompute
        method, a bf16 or fp16 model, no --moe-shared-expert-overlap."""
        a = self.a
        missing = []
        if ep <= 1:
            missing.append("--expert-model-parallel-size > 1")
        if pp > 1 and L is not None and virtual_size(a, L, pp) is None:
            missing.append("virtual pipeline stages (--num-virtual-stages-per-pipeline-rank) with pp > 1")
        if dispatcher not in ("alltoall", "flex"):
            missing.append(f"the alltoall or flex dispatcher (not {dispatcher})")
        gran = "selective" if a.has("--recompute-activations") else a.value("--recompute-granularity")
        if gran == "full" or a.has("--recompute-method") or a.has("--recompute-num-layers"):
            missing.append("no full recomputation (no --recompute-granularity full, --recompute-method, --recompute-num-layers)")
        if not (a.has("--bf16") or a.has("--fp16")):
            missing.append("--bf16 or --fp16")
        if a.has("--moe-shared-expert-overlap"):
            missing.append("no --moe-shared-expert-overlap")
        if missing:
            self.add(
                "MEG042",
                a.line("--overlap-moe-expert-parallel-comm"),
                f"--overlap-moe-expert-parallel-comm needs {'; '.join(missing)} (TransformerConfig asserts it).",
                "give what it needs, or drop --overlap-moe-expert-parallel-comm",
            )

    def cp_comm_rules(self, cp: int, tp: int) -> None:
        """--cp-comm-type: each value one Transformer Engine runs (DotProductAttention cp_comm_type: p2p, all_gather,
        a2a, a2a+p2p), one value or one per layer (TransformerConfig.__post_init__, megatron-core 0.16.1), a2a+p2p
        with --hierarchical-context-parallel-sizes, and a2a with heads per GPU that cp divides (mesh.cp_comm_problems)."""
        a = self.a
        flag = a.get("--cp-comm-type")
        types = list(flag.values) if flag is not None else []
        if not types or cp <= 1:
            return
        line = a.line("--cp-comm-type")
        bad = sorted({t for t in types if t not in CP_COMM_TYPES})
        if bad:
            self.add("MEG044", line, f"--cp-comm-type {' '.join(bad)}: Transformer Engine runs {', '.join(CP_COMM_TYPES)}.", "use one of those")
            return
        L = a.int("--num-layers")
        if len(types) > 1 and L is not None and len(types) != L:
            self.add(
                "MEG044",
                line,
                f"--cp-comm-type gives {len(types)} types for {L} layers (TransformerConfig asserts one per layer, or one for all).",
                "give one type, or one per layer",
            )
        if "a2a+p2p" in types and not a.has("--hierarchical-context-parallel-sizes"):
            self.add(
                "MEG044",
                line,
                "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (the a2a and p2p group sizes).",
                "add --hierarchical-context-parallel-sizes, or use p2p",
            )
        heads = a.int("--num-attention-heads")
        if "a2a" in types and heads is not None:
            groups = a.int("--num-query-groups") if a.has("--group-query-attention") else heads
            arch = {"num_attention_heads": heads, "num_query_groups": groups or heads}
            for why in cp_comm_problems("a2a", cp, tp, arch):
                self.add("MEG044", line, why + ".", "use --cp-comm-type p2p or all_gather, or a cp that divides the heads per GPU")

    def mla_rules(self) -> None:
        a = self.a
        if not a.has("--multi-latent-attention"):
            return
        if a.has("--group-query-attention"):
            self.add(
                "MEG040",
                a.line("--group-query-attention"),
                "--multi-latent-attention with --group-query-attention (validate_args: they are mutually exclusive).",
                "drop --group-query-attention and --num-query-groups",
            )
        rope_fused = (a.value("--position-embedding-type") or "learned_absolute") == "rope" and not a.has("--no-rope-fusion")
        if rope_fused and (a.value("--rope-type") or "yarn") != "yarn":
            self.add(
                "MEG040",
                a.line("--rope-type"),
                f"--multi-latent-attention with --rope-type {a.value('--rope-type')} and rope fusion on (MLATransformerConfig: fusion for MLA works with yarn only).",
                "add --no-rope-fusion",
            )

    def recompute_rules(self) -> None:
        a = self.a
        gran = a.value("--recompute-granularity")
        method = a.value("--recompute-method")
        num = a.get("--recompute-num-layers")
        ln = self.line("--recompute-granularity", "--recompute-activations", "--recompute-method")
        if a.has("--recompute-activations"):
            if gran is not None and gran != "selective":
                self.add(
                    "MEG020",
                    ln,
                    f"--recompute-activations means selective recomputation but --recompute-granularity is {gran!r} (validate_args overrides it to selective).",
                    "drop one of them",
                )
            gran = "selective"
        if gran is not None and gran not in ("full", "selective"):
            self.add("MEG020", ln, f"--recompute-granularity {gran!r} is not 'full' or 'selective'.", "use full or selective")
            return
        if method is not None and method not in ("uniform", "block"):
            self.add("MEG020", self.line("--recompute-method"), f"--recompute-method {method!r} is not 'uniform' or 'block'.", "use uniform or block")
        if gran == "full":
            missing = [n for n, present in (("--recompute-method", method is not None), ("--recompute-num-layers", num is not None)) if not present]
            if missing:
                self.add(
                    "MEG020",
                    ln,
                    f"full recomputation needs {' and '.join(missing)} (TransformerConfig raises ValueError).",
                    "add --recompute-method uniform --recompute-num-layers 1",
                )
        elif gran == "selective":
            extra = [n for n, present in (("--recompute-method", method is not None), ("--recompute-num-layers", num is not None)) if present]
            if extra:
                self.add(
                    "MEG020",
                    ln,
                    f"selective recomputation takes no {' or '.join(extra)} (validate_args / TransformerConfig refuse it).",
                    f"drop {' '.join(extra)}",
                )
        elif method is not None or num is not None:
            self.add(
                "MEG020",
                self.line("--recompute-method", "--recompute-num-layers"),
                "--recompute-method/--recompute-num-layers without --recompute-granularity full have no effect.",
                "add --recompute-granularity full, or drop them",
            )
        modules = a.get("--recompute-modules")
        if modules is not None and gran == "selective":
            ml = self.line("--recompute-modules")
            unknown = [m for m in modules.values if m not in RECOMPUTE_MODULES]
            if unknown:
                self.add(
                    "MEG020",
                    ml,
                    f"--recompute-modules {' '.join(unknown)}: not a module Megatron recomputes (TransformerConfig asserts).",
                    f"use {', '.join(RECOMPUTE_MODULES)}",
                )
            if "mla_up_proj" in modules.values and not a.has("--multi-latent-attention"):
                self.add(
                    "MEG020", ml, "--recompute-modules mla_up_proj needs --multi-latent-attention (TransformerConfig raises ValueError).", "drop mla_up_proj"
                )
            if "moe_act" in modules.values and not a.has("--moe-grouped-gemm"):
                self.add(
                    "MEG020",
                    ml,
                    "--recompute-modules moe_act needs --moe-grouped-gemm (TransformerConfig raises ValueError).",
                    "add --moe-grouped-gemm, or drop moe_act",
                )
        elif modules is not None:
            self.add(
                "MEG020",
                self.line("--recompute-modules"),
                "--recompute-modules has no effect without --recompute-granularity selective.",
                "add --recompute-granularity selective, or drop --recompute-modules",
            )


def check_megatron_args(args: MegatronArgs, world_size: int | None = None) -> list[Finding]:
    """Every rule of :data:`RULES` that ``args`` violates, sorted by rule id then line.

    ``world_size`` (GPUs) defaults to the torchrun world the script states; rules that need it
    (MEG002, MEG015, MEG016) are skipped when neither is known.
    """
    return _Checker(args, world_size).run()


def errors(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]
