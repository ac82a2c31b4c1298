"""`load(path, mesh=)` with two processes (issue 45, item 2): joined into one JAX cluster
(`jax.distributed.initialize`, 4 CPU devices each, gloo, 127.0.0.1), both load one release checkpoint
onto a global (4, 2) mesh whose "model" axis spans the two processes, so process p holds routed
experts [2p, 2p + 2) of each layer. Each process reads only its own devices' slices: of every expert
tensor it opens, only its own experts' (counted by wrapping `models.lazy_arrays.read`), and its shards
hold the values a single process loads. Children are this module run as
`python -m tests.models.test_streamed_load_processes child ...`; each writes a JSON report.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE = 180  # seconds
MODULE = "tests.models.test_streamed_load_processes"  # children run this module


def _child(port: str, work: str, pid: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    p = int(pid)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        coordinator_bind_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=p,
        initialization_timeout=DEADLINE // 2,
    )
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import Mesh

    import models.lazy_arrays as lazy
    import models.placement as placement
    from models.deepseek_v4 import load

    reads: list[dict] = []  # every read of a memory-mapped tensor: which tensor, which slice, its dtype
    real = lazy.read

    def counting(arr, index=(), out=None):
        got = real(arr, index, out)
        if getattr(arr, "filename", None):
            where = f"{os.path.basename(arr.filename)}@{arr.__array_interface__['data'][0] - lazy_base(arr)}"
            reads.append({"tensor": where, "slice": repr(index), "dtype": str(arr.dtype), "bytes": got.nbytes})
        return got

    def lazy_base(arr) -> int:
        return np.frombuffer(arr._mmap, np.uint8).__array_interface__["data"][0]

    lazy.read = placement.read = counting
    own = [[d for d in jax.devices() if d.process_index == q] for q in range(2)]
    mesh = Mesh(np.array([[own[0][i], own[1][i]] for i in range(4)]), ("data", "model"))  # "model" across processes
    model = load(os.path.join(work, "ckpt"), dtype=jnp.float32, mesh=mesh, progress_bars=False)
    mine = {}
    for k, v in nnx.to_flat_state(nnx.state(model)):
        a = v.get_value()
        if k[-2:] == ("w_gate", "data"):
            shard = a.addressable_shards[0]
            mine["/".join(map(str, k))] = {"index": [s.start or 0 for s in shard.index], "values": shard.data.tolist()}
    with open(os.path.join(work, f"child{p}.json"), "w") as f:
        json.dump({"reads": reads, "experts": mine, "process": jax.process_index()}, f)
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_process_reads_only_its_own_slices(tmp_path):
    import jax.numpy as jnp
    from flax import nnx

    from models.deepseek_v4 import load, random_tensors, tiny_config
    from models.deepseek_v4.release import write_release_checkpoint

    cfg = tiny_config()
    write_release_checkpoint(tmp_path / "ckpt", cfg, random_tensors(cfg, seed=2), fp8_block=16, max_shard_bytes=30_000)
    port, env = _free_port(), dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.models.test_streamed_load_processes",
                "child",
                str(port),
                str(tmp_path),
                str(p),
            ],
            env=env,
            cwd=ROOT,
            stdout=open(tmp_path / f"child{p}.log", "w"),  # noqa: SIM115 (the child keeps its own descriptor)
            stderr=subprocess.STDOUT,
        )
        for p in range(2)
    ]
    end = time.monotonic() + DEADLINE
    try:
        for p in procs:
            p.wait(timeout=max(1.0, end - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [(tmp_path / f"child{p}.log").read_text()[-3000:] for p in range(2)]
    assert [p.returncode for p in procs] == [0, 0], logs
    reports = [json.loads((tmp_path / f"child{p}.json").read_text()) for p in range(2)]
    single = {
        "/".join(map(str, k)): v.get_value()
        for k, v in nnx.to_flat_state(nnx.state(load(tmp_path / "ckpt", dtype=jnp.float32)))
    }
    for p, report in enumerate(reports):
        assert report["experts"], logs[p]
        for name, shard in report["experts"].items():
            start = shard["index"][-3]
            assert start == 2 * p  # process p holds experts [2p, 2p + 2)
            want = np.asarray(single[name])[..., start : start + 2, :, :]
            np.testing.assert_array_equal(np.asarray(shard["values"], np.uint8), want)
    # the routed experts (the only packed FP4, uint8, tensors): each read by its owner alone, whole
    experts = [{r["tensor"] for r in report["reads"] if r["dtype"] == "uint8"} for report in reports]
    n_expert_tensors = cfg.num_hidden_layers * 3 * cfg.n_routed_experts
    assert len(experts[0]) == len(experts[1]) == n_expert_tensors // 2
    assert not experts[0] & experts[1]
    # weights split by rows (query heads, the grouped output projection): each process read only its
    # half's rows of each, the same tensors
    full = repr((slice(None),) * 2)
    split = [
        {(r["tensor"], r["slice"]) for r in report["reads"] if r["dtype"] == "float8_e4m3fn" and r["slice"] != full}
        for report in reports
    ]
    assert split[0] and {t for t, _ in split[0]} == {t for t, _ in split[1]}
    assert not split[0] & split[1]


if __name__ == "__main__":
    if sys.argv[1] == "child":
        _child(*sys.argv[2:])
    else:
        pytest.main([__file__])
