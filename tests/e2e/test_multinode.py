"""Two torchrun agents on this machine emulate two nodes (c10d rendezvous): HSDP replicates across them."""

import os
import subprocess
import sys
from pathlib import Path

import torch
from _launch import free_port
from _parity import assert_parity

WORKER = Path(__file__).with_name("multinode_worker.py")


def test_two_nodes_train_hsdp_with_replicas_across_nodes(tmp_path):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=torchacc-test",
        str(WORKER),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(o[-3000:] for o in outputs)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert [(r["node"], r["local_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["local_master"] for r in results] == [True, False, True, False]
    assert [r["global_master"] for r in results] == [True, False, False, False]
    assert results[0]["mesh"] == [[0, 1], [2, 3]], "shard inside a node, replicate across nodes"
    assert_parity(results)
