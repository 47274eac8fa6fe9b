"""Real training code from well-known libraries, as a user runs it, under whichever allocator
the process has (start it under `allocwatch run`, or plain with PYTORCH_CUDA_ALLOC_CONF for
PyTorch's): each workload trains a few steps of a model built from a configuration (no weights
are downloaded) and prints one JSON line with peak reserved ÷ peak requested.

    python -m bench.gpu.dropin_workloads WORKLOAD [--steps N] [--json FILE]

Workloads: timm_cudnn (timm ResNet-50, cudnn.benchmark = True), hf_compile (a Hugging Face
GPT-2 under torch.compile, default mode), hf_reduce_overhead (the same under
mode="reduce-overhead": CUDA graph trees), lightning (a Lightning Trainer with
DeviceStatsMonitor), multiprocessing (torch.multiprocessing passing CUDA tensors to another
process and back). Run by bench/gpu/dropin_check.sh on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, cast

import torch

MiB = 1 << 20


def _allocator() -> str:
    module = sys.modules.get("allocator_ext.torch_integration")
    if module is not None and module.installed():
        return "allocwatch-native" if module.native() else "allocwatch-pluggable"
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return "pytorch-expandable" if "expandable_segments:True" in conf else "pytorch"


def _gpt2(n_layer: int = 4) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_embd=512, n_head=8, n_positions=512, vocab_size=8192)
    model: torch.nn.Module = GPT2LMHeadModel(config)
    return model.cuda()


def _lm_steps(model: torch.nn.Module, steps: int, seqs: list[int]) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for step in range(steps):
        seq = seqs[step % len(seqs)]
        ids = torch.randint(0, 8192, (8, seq), device="cuda", generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def timm_cudnn(steps: int) -> dict[str, Any]:
    import timm

    torch.backends.cudnn.benchmark = True
    model = timm.create_model("resnet50", pretrained=False).cuda()
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        batch = 32 if step % 3 else 24  # changing shapes: benchmark mode searches again
        x = torch.randn(batch, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {"model": "timm resnet50", "cudnn_benchmark": True}


def hf_compile(steps: int) -> dict[str, Any]:
    model = cast(torch.nn.Module, torch.compile(_gpt2()))  # a module that compiles its forward
    _lm_steps(model, steps, [256])
    return {"model": "transformers GPT-2 (4 layers)", "compile": "default"}


def hf_reduce_overhead(steps: int) -> dict[str, Any]:
    model = cast(torch.nn.Module, torch.compile(_gpt2(), mode="reduce-overhead"))
    _lm_steps(model, steps, [128, 256])
    return {"model": "transformers GPT-2 (4 layers)", "compile": "reduce-overhead"}


def lightning(steps: int) -> dict[str, Any]:
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import DeviceStatsMonitor
        from lightning.pytorch.loggers import CSVLogger
    except ImportError:
        import pytorch_lightning as pl  # type: ignore[no-redef]
        from pytorch_lightning.callbacks import DeviceStatsMonitor  # type: ignore[no-redef]
        from pytorch_lightning.loggers import CSVLogger  # type: ignore[no-redef]

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(),
                                           torch.nn.Linear(4096, 1024))

        def training_step(self, batch: Any, _index: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(64 * steps, 1024),
                                          torch.randn(64 * steps, 1024))
    loader = torch.utils.data.DataLoader(data, batch_size=64)
    with tempfile.TemporaryDirectory() as logs:
        trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=steps,
                             callbacks=[DeviceStatsMonitor()], logger=CSVLogger(logs),
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, log_every_n_steps=1)
        trainer.fit(Regression(), loader)
        logged = open(os.path.join(trainer.logger.log_dir, "metrics.csv")).readline()
    memory_columns = [c for c in logged.strip().split(",") if "allocated_bytes" in c]
    assert memory_columns, f"DeviceStatsMonitor logged no memory statistics: {logged[:300]}"
    return {"model": "Lightning MLP", "device_stats_columns": len(memory_columns)}


def _consumer(requests: Any, replies: Any) -> None:
    while True:
        t = requests.get()
        if t is None:
            return
        replies.put(t * 2)  # a CUDA tensor back the other way


def multiprocessing(steps: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_consumer, args=(requests, replies))
    child.start()
    try:
        for step in range(steps):
            t = torch.full(((step % 4 + 1) * MiB,), float(step), device="cuda")
            requests.put(t)
            back = replies.get(timeout=120)
            assert torch.equal(back, t * 2), step
            del back
        requests.put(None)
        child.join(60)
    finally:
        if child.is_alive():
            child.terminate()
    return {"model": "CUDA tensors through torch.multiprocessing queues", "exchanges": steps}


WORKLOADS = {f.__name__: f for f in (timm_cudnn, hf_compile, hf_reduce_overhead, lightning,
                                     multiprocessing)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", help="append the result line to this file")
    args = parser.parse_args()
    result: dict[str, Any] = {"workload": args.workload, "allocator": _allocator(),
                              "torch": torch.__version__}
    start = time.perf_counter()
    try:
        result.update(WORKLOADS[args.workload](args.steps))
        stats = torch.cuda.memory_stats()
        requested = stats.get("requested_bytes.all.peak", 0)
        reserved = stats.get("reserved_bytes.all.peak", 0)
        result.update(ok=True, peak_requested_bytes=requested, peak_reserved_bytes=reserved,
                      reserved_ratio=round(reserved / requested, 4) if requested else None)
    except Exception as e:  # the report says what broke; the exit status too
        result.update(ok=False, error=f"{type(e).__name__}: {str(e)[:600]}",
                      traceback=traceback.format_exc()[-3000:])
    result["allocator"] = _allocator()  # after the run: installed at torch's import
    result["seconds"] = round(time.perf_counter() - start, 1)
    line = json.dumps(result)
    print(line, flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(line + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
