"""Render a plan for torchtitan: launch_torchtitan.sh (torchrun -m torchtitan.train + CLI overrides), README.md.

torchtitan 0.3.0 reads no job-config TOML: a job is ``--module llama3 --config <config_registry function>``
plus tyro overrides (torchtitan/config/manager.py ``ConfigManager.parse_args``). The plan becomes those
overrides: pipeline degree, schedule, micro-batch size, the modules of every stage
(``--parallelism.module_fqns_per_model_part``, one comma-separated word per stage), data-parallel degrees,
batch sizes, sequence length, precision and activation checkpointing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from planner.engines.base import repeated_layers
from planner.engines.torchtitan.loss import LOSS_CHUNKS
from planner.engines.torchtitan.rules import SCHEDULE_NAMES
from planner.errors import UsageError
from planner.launch import cluster_shape
from planner.solve.plan import Plan
from planner.solve.schedules import SCHEDULE_INFO
from planner.templating import one_line, render_template

SCRIPT = "launch_torchtitan.sh"
#: the config_registry module a Float8 plan launches (torchtitan 0.3.0 sets Float8 in the model spec, which its
#: command line does not reach: Trainer.Config.model_spec is tyro.conf.Suppress)
CONFIG_MODULE = "torchtitan_plan"
#: torchao Float8 recipe (Float8LinearConverter.Config.recipe_name; the default, and the one priced)
FLOAT8_RECIPE = "rowwise"

#: our piece names outside the transformer layers -> torchtitan Llama's module names (models/common/decoder.py)
TOP_MODULES = {"tok_embeddings": "tok_embeddings", "norm": "norm", "output": "lm_head", "lm_head": "lm_head"}
_LAYER = re.compile(r"layers\.(\d+)")
#: a decoder layer by its module path's end (transformers' ``model.layers.N``)
_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)$")


@dataclass(frozen=True)
class Flavor:
    """One llama3 config_registry function of torchtitan 0.3.0 and the model it builds (models/llama3/__init__.py)."""

    config: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    #: the llama3 ``model_registry`` flavor the function builds (models/llama3/__init__.py ``llama3_configs``)
    flavor: str


#: read from torchtitan 0.3.0's llama3 config_registry (llama3_405b from models/llama3/__init__.py ``_405b``)
FLAVORS = (
    Flavor("llama3_debugmodel", 6, 256, 16, 16, 768, 2048, "debugmodel"),
    Flavor("llama3_8b", 32, 4096, 32, 8, 14336, 128256, "8B"),
    Flavor("llama3_70b", 80, 8192, 64, 8, 28672, 128256, "70B"),
    Flavor("llama3_405b", 126, 16384, 128, 8, 53248, 128256, "405B"),
)

PRECISION = {"bf16": "bfloat16", "fp32": "float32"}
#: our recompute mode -> the tyro subcommand of Trainer.Config.activation_checkpoint (torchtitan 0.3.0
#: distributed/activation_checkpoint.py ActivationCheckpointingConfig: selective, full, memory-budget, none)
AC_SUBCOMMANDS = {"none": "none", "selective": "selective", "full": "full"}


def piece_fqn(name: str, block: str | None) -> str:
    """torchtitan's module name for one of our pieces named as torchtitan's Llama names its modules; a UsageError for
    a name its Llama has not."""
    if block is not None and _LAYER.fullmatch(block):
        return block
    if block is None and name in TOP_MODULES:
        return TOP_MODULES[name]
    raise UsageError(
        f"piece {name!r} (block {block!r}) is not a torchtitan Llama module (tok_embeddings, layers.N, norm, output/lm_head).",
        "The torchtitan engine plans torchtitan's own Llama: name the model's modules as examples/llama.py does, or use --engine torch.",
    )


def piece_fqns(pieces: list[str], blocks: list[str | None]) -> list[str]:
    """torchtitan's module name for each piece. Named as torchtitan names its Llama's modules, by :func:`piece_fqn`;
    otherwise by position, for a decoder whose blocks are ``...layers.N`` (transformers' ``model.layers.N``): the
    pieces before the first block are the embedding, the last piece is the output layer and those between the last
    block and it the final norm. A UsageError where neither holds."""
    try:
        return [piece_fqn(name, block) for name, block in zip(pieces, blocks)]
    except UsageError:
        at = [i for i, b in enumerate(blocks) if b is not None]
        layers = [_DECODER_LAYER.search(b) for b in blocks if b is not None]
        if not at or not all(layers) or at[-1] + 2 > len(pieces):
            raise
        first, last = at[0], at[-1]
        out = []
        for i, block in enumerate(blocks):
            if block is not None:
                found = _DECODER_LAYER.search(block)
                assert found is not None
                out.append(f"layers.{found.group(1)}")
            else:
                out.append("tok_embeddings" if i < first else "lm_head" if i == len(pieces) - 1 else "norm" if i > last else "")
        if "" in out:  # a piece between two blocks that is none of them
            raise
        return out


def stage_fqns(plan: Plan) -> list[list[str]]:
    """``module_fqns_per_model_part``: the torchtitan modules of each planned stage, in stage order.

    Refuses (UsageError) a plan whose modules are not exactly tok_embeddings, layers.0 .. layers.N-1, norm,
    lm_head in order, or that splits a module over two stages.
    """
    pieces, blocks = plan.model["pieces"], plan.model["blocks"]
    fqns = piece_fqns(list(pieces), list(blocks))
    parts: list[list[str]] = []
    for stage in plan.stages:
        names: list[str] = []
        for i in range(*stage.pieces):
            fqn = fqns[i]
            if not names or names[-1] != fqn:
                names.append(fqn)
        parts.append(names)
    flat = [f for part in parts for f in part]
    layers = sum(1 for f in flat if f.startswith("layers."))
    expected = ["tok_embeddings", *(f"layers.{i}" for i in range(layers)), "norm", "lm_head"]
    if flat != expected:
        raise UsageError(
            "the plan's stages do not list torchtitan's Llama modules once each, in order "
            f"(tok_embeddings, layers.0 .. layers.{layers - 1}, norm, lm_head); got {', '.join(flat)}.",
            "Re-plan with --engine torchtitan (it cuts only between whole layers).",
        )
    return parts


def torchtitan_stage_ranks(schedule: str, pp: int, stages: int) -> list[int]:
    """The pipeline rank torchtitan puts each stage on (pipeline_parallel.py ``_get_pp_rank_to_stage_indices_mapping``)."""
    if SCHEDULE_INFO[schedule].placement == "v":
        return [s if s < pp else stages - 1 - s for s in range(stages)]
    return [s % pp for s in range(stages)]


def closest_flavor(plan: Plan) -> Flavor:
    """The registry function whose model is nearest the planned one (layers and hidden size, on a log scale)."""
    arch = plan.model.get("architecture") or {}
    layers = int(arch.get("num_layers") or len({b for b in repeated_layers(plan.model["blocks"]) if b}))
    dim = int(arch.get("hidden_size") or 0)

    def distance(f: Flavor) -> float:
        return abs(math.log(f.n_layers / max(layers, 1))) + (abs(math.log(f.dim / dim)) if dim > 0 else 0.0)

    return min(FLAVORS, key=distance)


def loss_chunks(plan: Plan) -> int:
    """The chunks of torchtitan's ChunkedLossWrapper the plan was priced with (``--loss.num_chunks``)."""
    return plan.settings.memory.loss_chunks or LOSS_CHUNKS


def compile_components(plan: Plan) -> list[str]:
    """What torch.compile compiles (CompileConfig.components): the model's blocks (Layout.compile) and the loss
    (``--compile-loss``, by default with ``--compile``)."""
    return [name for name, on in (("model", plan.layout.compile), ("loss", plan.settings.loss_run.compiled)) if on]


def param_dtype(plan: Plan) -> str:
    """The parameters' mixed-precision dtype: bf16 under Float8 (``--dtype fp8``: FP8 GEMMs on bf16 weights)."""
    return "bf16" if plan.settings.model.dtype == "fp8" else plan.settings.model.dtype


def check_renderable(plan: Plan) -> None:
    """A UsageError saying why torchtitan cannot run ``plan`` (none when it can)."""
    lay = plan.layout
    if lay.engine != "torchtitan":
        raise UsageError(f"render_torchtitan got a plan for engine {lay.engine!r}.", "Plan with --engine torchtitan.")
    if lay.schedule not in SCHEDULE_NAMES:
        raise UsageError(f"torchtitan does not run schedule {lay.schedule!r}.", f"Pick one with --schedule: {', '.join(SCHEDULE_NAMES)}.")
    chunks = loss_chunks(plan)
    seq = plan.model.get("seq_len")
    if seq and (int(seq) // lay.cp) % chunks:
        raise UsageError(
            f"torchtitan's ChunkedLossWrapper splits each rank's sequence into {chunks} chunks, and {int(seq) // lay.cp} tokens "
            f"(the sequence over cp {lay.cp}) do not divide by {chunks}.",
            "Plan with --loss-chunks set to a divisor of the tokens each rank holds.",
        )
    if lay.tp_comm_overlap and not lay.compile:
        raise UsageError("torchtitan's async TP needs torch.compile of the model; the plan has async TP without it.", "Plan with --compile.")
    if lay.zero not in (0, 3):
        raise UsageError(f"torchtitan runs FSDP2 (ZeRO 3) or replicated data parallelism (ZeRO 0), not ZeRO {lay.zero}.", "Plan with --zero 0 or --zero 3.")
    dtype = param_dtype(plan)
    if dtype not in PRECISION:
        raise UsageError(f"torchtitan trains bf16 or fp32 parameters (training.mixed_precision_param), not {dtype}.", "Plan with --dtype bf16 or fp32.")
    if len(plan.stages) != lay.pp * lay.vp:
        raise UsageError(f"plan.json has {len(plan.stages)} stages for pp={lay.pp} x vp={lay.vp}.")
    ranks = torchtitan_stage_ranks(lay.schedule, lay.pp, len(plan.stages))
    if [s.rank for s in plan.stages] != ranks:
        raise UsageError(f"plan.json puts stages on ranks {[s.rank for s in plan.stages]}; torchtitan's {SCHEDULE_NAMES[lay.schedule]} puts them on {ranks}.")


def override_groups(plan: Plan) -> list[list[str]]:
    """The torchtitan CLI overrides that carry the plan, one flag with its values per list (argv words)."""
    check_renderable(plan)
    lay = plan.layout
    sharded = lay.zero >= 3
    groups = [
        ["--parallelism.pipeline_parallel_degree", str(lay.pp)],
        ["--parallelism.pipeline_parallel_schedule", SCHEDULE_NAMES[lay.schedule]],
        ["--parallelism.pipeline_parallel_microbatch_size", str(lay.micro_batch)],
        ["--parallelism.module_fqns_per_model_part", *(",".join(part) for part in stage_fqns(plan))],
        ["--parallelism.data_parallel_replicate_degree", str(1 if sharded else lay.dp)],
        ["--parallelism.data_parallel_shard_degree", str(lay.dp if sharded else 1)],
        ["--parallelism.tensor_parallel_degree", str(lay.tp)],
        ["--parallelism.context_parallel_degree", str(lay.cp)],
        ["--training.local_batch_size", str(lay.micro_batch * lay.num_microbatches)],
        ["--training.global_batch_size", str(lay.global_batch)],
        ["--training.mixed_precision_param", PRECISION[param_dtype(plan)]],
    ]
    if plan.model.get("seq_len"):
        groups.append(["--training.seq_len", str(plan.model["seq_len"])])
    groups.append(["--loss.num_chunks", str(loss_chunks(plan))])
    if lay.tp > 1:  # ParallelismConfig.enable_sequence_parallel (default True): the planned sequence parallelism
        groups.append(["--parallelism.enable_sequence_parallel" if lay.sequence_parallel else "--parallelism.no-enable_sequence_parallel"])
    # CompileConfig (config/configs.py): enable, components (default model and loss), enable_async_tensor_parallel
    components = compile_components(plan)
    groups.append(["--compile.enable", "--compile.components", ",".join(components)] if components else ["--compile.no-enable"])
    if lay.tp > 1:
        groups.append(["--compile.enable_async_tensor_parallel" if lay.tp_comm_overlap else "--compile.no-enable_async_tensor_parallel"])
    if lay.pp > 1:  # Trainer.Config._validate_cuda_graphs: "CUDA graphs do not support pipeline parallelism yet"
        groups.append(["--training.disable_cuda_graphs"])
    # tyro subcommand for Trainer.Config.activation_checkpoint (every registry function sets its own); it must come last
    groups.append([f"activation-checkpoint:{AC_SUBCOMMANDS[lay.recompute]}"])
    return groups


def overrides(plan: Plan) -> list[str]:
    """The words after ``--module``/``--config`` that carry the plan (what ConfigManager.parse_args reads)."""
    return [word for group in override_groups(plan) for word in group]


def _differences(plan: Plan, flavor: Flavor) -> list[str]:
    arch = plan.model.get("architecture") or {}
    pairs = (
        ("layers", arch.get("num_layers"), flavor.n_layers),
        ("hidden size", arch.get("hidden_size"), flavor.dim),
        ("attention heads", arch.get("num_attention_heads"), flavor.n_heads),
        ("key/value heads", arch.get("num_query_groups"), flavor.n_kv_heads),
        ("FFN size", arch.get("ffn_hidden_size"), flavor.ffn_dim),
        ("vocabulary", arch.get("vocab_size"), flavor.vocab_size),
    )
    return [one_line(f"{name}: planned {mine}, {flavor.config} builds {theirs}") for name, mine, theirs in pairs if mine is not None and int(mine) != theirs]


def registry_function(plan: Plan) -> tuple[str, str]:
    """(``--module``, ``--config``) the launch script defaults to: torchtitan's llama3 function closest to the planned
    model, or for a Float8 plan the function of :data:`CONFIG_MODULE` that wraps it."""
    flavor = closest_flavor(plan)
    if plan.layout.fp8:
        return CONFIG_MODULE, f"{flavor.config}_float8"
    return "llama3", flavor.config


def render(plan: Plan, command: str, out_dir: Path | None = None) -> dict[str, str]:
    """The torchtitan engine's files of the plan directory as {relative path: text} (deterministic)."""
    groups = override_groups(plan)
    lay = plan.layout
    flavor = closest_flavor(plan)
    module, function = registry_function(plan)
    nodes, nprocs = cluster_shape(plan)
    ctx = dict(
        command=one_line(command),
        layout_short=one_line(lay.short()),
        nodes=nodes,
        nprocs=nprocs,
        config=flavor.config,
        module=module,
        function=function,
        flavor=flavor.flavor,
        float8_recipe=FLOAT8_RECIPE,
        fp8=lay.fp8,
        compile=lay.compile,
        compile_components=compile_components(plan),
        loss_chunks=loss_chunks(plan),
        tp=lay.tp,
        cp=lay.cp,
        sequence_parallel=lay.sequence_parallel,
        async_tp=lay.tp_comm_overlap,
        groups=groups,
        parts=[", ".join(part) for part in stage_fqns(plan)],
        stage_ranks=[s.rank for s in plan.stages],
        schedule=lay.schedule,
        torch_schedule=SCHEDULE_NAMES[lay.schedule],
        pp=lay.pp,
        vp=lay.vp,
        dp=lay.dp,
        zero=lay.zero,
        micro_batch=lay.micro_batch,
        num_microbatches=lay.num_microbatches,
        global_batch=lay.global_batch,
        recompute=lay.recompute,
        differences=_differences(plan, flavor),
    )
    files = {
        SCRIPT: render_template("torchtitan/launch_torchtitan.sh.j2", **ctx),
        "README.md": render_template("torchtitan/README.md.j2", **ctx),
    }
    if lay.fp8:
        files[f"{CONFIG_MODULE}.py"] = render_template("torchtitan/torchtitan_plan.py.j2", **ctx)
    return files
