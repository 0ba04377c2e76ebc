"""model.pretrained's memory while loading (issue 40, "must show" 2): on 2 fully_sharded ranks (CPU, gloo) each rank
reads only its slices of a ~50 MB bf16 Llama folder (~100 MB in fp32, the ranks' dtype), so the load itself needs
no more than one slice beside the shard the rank already holds, and no rank ever holds the full model.

"Peak" is a rank's private resident memory (RSS without file-backed pages, as shardlab.memory.meter counts it)
at its highest during the load, above what it held when the load began (the sharded model materialized; Linux's
VmHWM, reset through /proc/self/clear_refs). DCP's HuggingFaceStorageReader reads through ``safe_open``, which maps
each file: the pages a rank touches are the page cache's (clean, shared by the ranks of a node, dropped under
pressure), as the shared libraries' are, and count out; what it copies out of the map counts in. The meter as the
trainer reads a step would count the mapped pages at their peak (they are unmapped by the end): PrivatePeak cuts the
load into windows instead, and that reading is reported too. A control in the same ranks reads the whole folder into
memory (each tensor copied out of safetensors' load_file) under the same PrivatePeak, so the bound is the loader's
and not a reading that sees nothing.
"""

from __future__ import annotations

import math
import sys

import pytest

from tests.distributed.harness import run_spawned
from tests.hf_folders import make_folder

MB = 1 << 20
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)
"""~25M parameters: 50 MB in the bf16 files, 100 MB in the ranks' fp32; the largest tensor 0.8M (3 MB in fp32)."""
SLACK = 3 * MB
"""The load's own overhead beside the slice: DCP's plans and metadata of ~80 entries, safetensors' headers and the
interpreter's small objects (the whole private peak, slice included, measured 1.4-1.6 MB at world size 2)."""

MEASURED: dict = {}


class PrivatePeak:
    """The peak of a rank's private resident memory (RSS without its file-backed pages) over code that maps files,
    above its start. The meter's VmHWM counts the mapped pages at their peak, and they are unmapped by the end, so the
    code is cut into windows (``cut``: VmHWM reset at each), each taken as its VmHWM less the file-backed pages at its
    start. Cuts fall where a file is opened and closed (``watched``) and around each read request: inside a window
    file pages are only added (a request touching its slice) or only dropped (a close, which allocates nothing), so
    a reading is over the truth by at most one slice's pages, never under it."""

    def __init__(self) -> None:
        from shardlab.memory.meter import _CLEAR_REFS, file_backed_bytes, private_resident_bytes

        self.clear, self.file_backed = _CLEAR_REFS, file_backed_bytes
        self.baseline = private_resident_bytes()
        self.peak = 0
        self._open()

    def _open(self) -> None:
        self.file_at_start = self.file_backed()
        self.clear.write_text("5")  # VmHWM := the resident size now

    def cut(self) -> None:
        from shardlab.memory.meter import _status_kib

        high = (_status_kib("VmHWM") or 0) * 1024
        self.peak = max(self.peak, high - self.file_at_start - self.baseline)
        self._open()

    def watched(self, safe_open):
        """``safe_open`` (safetensors') whose ``with`` block is cut where the file is mapped and unmapped."""
        peak = self

        class Watched:
            def __init__(self, *args, **kwargs) -> None:
                self.args, self.kwargs = args, kwargs

            def __enter__(self):
                peak.cut()
                self.inner = safe_open(*self.args, **self.kwargs)
                opened = self.inner.__enter__()
                peak.cut()
                return opened

            def __exit__(self, *exc):
                peak.cut()
                try:
                    return self.inner.__exit__(*exc)
                finally:
                    peak.cut()

        return Watched


def measure_the_load() -> None:
    """In each rank, before its run: shardlab's load_hf_folder under PrivatePeak (its peak above the resident memory
    when the load starts, when the rank's shard is materialized), the same load again under the meter as the trainer
    reads a step (the mapped pages counted at their peak), then the whole folder read into memory under PrivatePeak
    (the control: every tensor copied, as a loader that builds the full model on a rank would)."""
    import safetensors
    import torch
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from shardlab.checkpoint import hf_folder
    from shardlab.memory.meter import PeakMeter, private_resident_bytes

    MEASURED["start"] = private_resident_bytes()
    original, read_one, safe_open = (
        hf_folder.load_hf_folder, HuggingFaceStorageReader._process_read_request, safetensors.safe_open
    )  # fmt: skip

    def private_peak(model, folder, names, device, *args, **kwargs) -> int:
        peak = PrivatePeak()

        def read_in_a_window(self, f, req, planner):
            peak.cut()
            read_one(self, f, req, planner)
            peak.cut()

        HuggingFaceStorageReader._process_read_request = read_in_a_window
        safetensors.safe_open = peak.watched(safe_open)  # the reader and hf_folder import it inside their functions
        try:
            original(model, folder, names, device, *args, **kwargs)
        finally:
            HuggingFaceStorageReader._process_read_request, safetensors.safe_open = read_one, safe_open
        peak.cut()
        return peak.peak

    def measured(model, folder, names, device, *args, **kwargs):
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        shard = sum(t.nbytes for t in local)
        # The weights a folder fills are not drawn first (Task.pretrained_keys), so to_empty's pages are untouched
        # until the load writes them; touched here, the peak is the load's own above a resident shard, as it was.
        with torch.no_grad():
            for t in local:
                t.zero_()
        before = private_resident_bytes()
        load_peak = private_peak(model, folder, names, device, *args, **kwargs)
        MEASURED.update(shard=shard, before=before, load_peak=load_peak)
        meter = PeakMeter(device)  # the same load again, read as the trainer's meter reads a step
        original(model, folder, names, device, *args, **kwargs)
        meter.sample()
        MEASURED["with_mapped_pages"] = meter.peak_above_baseline
        from safetensors.torch import load_file

        peak = PrivatePeak()
        # load_file's tensors are views of the file's map (file-backed): a copy of each is the model held in memory.
        whole = [{k: t.clone() for k, t in load_file(str(f)).items()} for f in hf_folder.weight_files(folder)]
        peak.cut()
        MEASURED["control_peak"] = peak.peak
        del whole

    hf_folder.load_hf_folder = measured


def gather(trainer) -> dict:
    """Every rank's measurements, on rank 0."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dict(MEASURED))
    return {"ranks": everyone}


def folder_sizes(folder) -> tuple[int, int, int]:
    """(bytes of the folder's tensors as stored, the model's in fp32, the largest tensor's in fp32)."""
    from shardlab.checkpoint.hf_folder import tensor_shapes, weight_files

    shapes = tensor_shapes(weight_files(folder))
    numels = [math.prod(shape) for shape, _ in shapes.values()]
    return 2 * sum(numels), 4 * sum(numels), 4 * max(numels)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the peak is read from /proc (VmHWM, clear_refs)")
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_each_rank_loads_within_its_shard_and_one_tensor(tiny_lm, tmp_path, world):
    folder = make_folder("llama3", tmp_path / "llama3", shape=SHAPE, max_shard_size="8MB")
    stored, model, largest = folder_sizes(folder)
    assert stored > 48 * MB and largest < 4 * MB and len(list(folder.glob("*.safetensors"))) >= 3
    cfg = tiny_lm(
        f"model.pretrained={folder}", "distributed=fully_sharded", f"distributed.world_size={world}",
        "distributed.cpu_allocator=lean", "optimization.max_steps=1", f"optimization.batch_size={2 * world}",
        "data.seq_len=16", "validation.interval_steps=0", "checkpoint.save=false", "lr_scheduler.warmup_steps=0",
    )  # fmt: skip
    (result,) = run_spawned([cfg], world, run_dirs=[tmp_path / "run"], inspect=gather, prepare=measure_the_load,
                            start_method="spawn")  # fmt: skip
    ranks = result["ranks"]
    lines = [
        f"rank {r}: shard {m['shard'] / MB:.1f} MB, load peak {m['load_peak'] / MB:.1f} MB above the materialized "
        f"shard ({m['with_mapped_pages'] / MB:.1f} MB with the mapped file pages; the rank "
        f"{(m['before'] - m['start'] + m['load_peak']) / MB:.1f} MB above its start), whole-folder control "
        f"{m['control_peak'] / MB:.1f} MB"
        for r, m in enumerate(ranks)
    ]
    report = f"model {model / MB:.1f} MB fp32 ({stored / MB:.1f} MB bf16 files), largest tensor {largest / MB:.1f} MB"
    print("\n".join([report, *lines]))
    largest_file = max(f.stat().st_size for f in folder.glob("*.safetensors"))
    for m in ranks:
        assert m["shard"] == pytest.approx(model / world, rel=0.05), report
        # The load writes into the shard in place: beside it, one slice (bf16, then converted) and some planning.
        assert m["load_peak"] < largest + SLACK, "\n".join([report, *lines])
        assert m["shard"] + m["load_peak"] < model / world + largest + SLACK
        assert m["shard"] + m["load_peak"] < 0.75 * model  # no rank holds the full model, at world size 2 either
        # With the page cache counted: the pages of the one file open at a time, at most.
        assert m["with_mapped_pages"] < largest + largest_file + SLACK, "\n".join([report, *lines])
        assert m["control_peak"] > 0.8 * stored  # the meter sees a folder read whole: the bounds above are the loader's
