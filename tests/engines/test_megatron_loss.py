"""Megatron's loss under ``--engine megatron``: computed inside the model by megatron-core's vocab-parallel cross
entropy (run here on CPU, one gloo rank), so the last stage holds no buffers for the model's output and its working set
is the logits once; the engines that run the user's loss_fn keep the output and its gradient as a boundary pair."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from planner import hardware
from planner.engines import get_engine
from planner.engines.megatron.rules import megatron_loss_working_set
from planner.solve.search import Context
from planner.solve.settings import Settings

CROSS_ENTROPY = textwrap.dedent(
    """
    import json, os, socket, torch, torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    s, b, V = 8, 2, 64
    logits = torch.randn(s, b, V, dtype=torch.bfloat16, requires_grad=True)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        loss = vocab_parallel_cross_entropy(logits * 1.0, torch.randint(0, V, (s, b)))
    loss.sum().backward()
    print(json.dumps({"kept": [[str(t.dtype), t.numel()] for t in kept], "grad": str(logits.grad.dtype), "n": s * b * V}), flush=True)
    # torn down before exit: a process group left to the interpreter's exit aborted now and then (gloo's threads,
    # "terminate called without an active exception")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    """
)


def test_megatron_cross_entropy_keeps_one_fp32_copy_and_returns_the_logits_dtype():
    """What megatron_loss_working_set rests on: the loss saves one fp32 tensor of the logits' size (its softmax, made in
    place from its fp32 copy; plus a token mask and target ids), and the logits' gradient comes back in their dtype."""
    pytest.importorskip("megatron.core")
    out = subprocess.run([sys.executable, "-c", CROSS_ENTROPY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    big = [k for k in got["kept"] if k[1] == got["n"]]
    assert big == [["torch.float32", got["n"]]]
    assert all(k[1] <= got["n"] // 64 for k in got["kept"] if k not in big)  # per-token masks and ids
    # ... a bool mask and int64 ids, one per token: megatron_loss_working_set's LOSS_TOKEN_BYTES
    assert sorted(k[0] for k in got["kept"] if k not in big) == ["torch.bool", "torch.int64"]
    assert got["grad"] == "torch.bfloat16"


@pytest.fixture(scope="module")
def tiny():
    from tests.conftest import costs_of

    return costs_of("llama", "llama-tiny")


def _ctx(costs, engine):
    return Context(costs, hardware.parse_gpus("2xH100-SXM"), Settings.of(engine=engine, global_batch=8), get_engine(engine))


@pytest.mark.parametrize("tp,mb", [(1, 1), (2, 4)])
def test_megatron_last_stage_holds_the_logits_once_and_no_output_buffers(tiny, tp, mb):
    """llama-tiny (vocabulary 256, s 32): under Megatron the whole model's transient bytes are the largest of the blocks'
    operator outputs and the bf16 logits per GPU (mb x s x V / tp x 2); the torch engine keeps the traced loss's largest
    output and the output's buffer pair 2 x (cut 0 + cut n)."""
    s, V = 32, 256
    n = tiny.n
    meg = _ctx(tiny, "megatron")
    trans = meg.transient(mb, tp, "none", True, 1)
    layers = meg.engine.layer_activations(meg.sharded(mb, tp, True, 1), tp, tp > 1, 1, "none").layers
    assert layers[-1].kind == "head" and layers[-1].max_op_bytes == mb * s * V // tp * 2
    assert trans[0, n] == pytest.approx(max(l.max_op_bytes for l in layers))
    torch_ctx = _ctx(tiny, "torch")
    t_layers = torch_ctx.sharded(mb, 1, True, 1)
    assert torch_ctx.transient(mb, 1, "none", True, 1)[0, n] == pytest.approx(
        2.0 * (t_layers.cuts[0].bytes + t_layers.cuts[n].bytes) + max(l.max_op_bytes for l in t_layers.layers)
    )


def test_models_without_a_head_or_a_vocabulary_keep_the_traced_working_set(tiny):
    from dataclasses import replace

    no_vocab = replace(tiny, architecture={k: v for k, v in tiny.architecture.items() if k != "vocab_size"})
    assert megatron_loss_working_set(no_vocab, 1, 1) is no_vocab
    headless = replace(tiny, layers=tiny.layers[:-1] + (replace(tiny.layers[-1], kind="norm"),))
    assert megatron_loss_working_set(headless, 1, 1) is headless


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True), (4, False)])
def test_megatron_output_piece_keeps_its_input_and_the_fp32_vocabulary_shard(tiny, tp, sp):
    """The output piece keeps its input (the cut into it, sharded over tp with sequence parallelism only) and the loss's
    fp32 copy of this rank's vocabulary shard, mb x s x V / tp x 4 bytes, with or without sequence parallelism (the
    logits are split over tp either way); the traced piece's saved bytes, divided by tp only with it, are not used."""
    s, V, mb = 32, 256, 2
    sharded = _ctx(tiny, "megatron").sharded(mb, tp, sp, 1)
    layers = get_engine("megatron").layer_activations(sharded, tp, sp and tp > 1, 1, "none").layers
    assert layers[-1].saved_bytes == sharded.cuts[sharded.n - 1].bytes + mb * s * V // tp * 4 + mb * s * (1 + 8)
