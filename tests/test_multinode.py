"""Several hosts through torchrun's own rendezvous: ``NNODES``, ``NODE_RANK``, ``RDZV_ENDPOINT``.

* Bad launcher variables stop run_train.sh with one ``error:`` line, exit 2, no torchrun.
* The pre-check counts ``NNODES x NGPU`` ranks.
* Two "hosts" of 2 CPU ranks on the loopback interface train bitwise as one host of 4 ranks
  (loss and grad norm, every step), and ``NODE_RANK`` decides the ranks: global rank 0, which
  writes ``metrics.jsonl``, is on the ``NODE_RANK=0`` host even when that host starts last.
  The one-host run is the ``fsdp4_run`` fixture of tests/conftest.py (also checked by
  tests/test_parallel_layouts.py).
"""

import os
import signal
import socket
import subprocess

import pytest

from graph_trainer import config
from graph_trainer.errors import UserError
from graph_trainer.metrics import read_metrics

from _runs import LAUNCH_VARS, fsdp4_flags  # tests/ is on sys.path
from _runs import launch_env as _env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = fsdp4_flags()


@pytest.mark.parametrize("launch, needle", [
    ({"NNODES": "2"}, "RDZV_ENDPOINT"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2"),
    ({"NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "127.0.0.1:29500"}, "NODE_RANK=2"),
    ({"NNODES": "two"}, "NNODES=two"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "127.0.0.1"}, "RDZV_ENDPOINT=127.0.0.1"),
], ids=["no endpoint", "node_rank too large", "node_rank too large, endpoint", "nnodes not a number",
        "endpoint without port"])
def test_bad_launch_variables_refused(launch, needle, tmp_path):
    r = subprocess.run(["bash", "run_train.sh", "--job.dump_folder", str(tmp_path / "out")], cwd=REPO,
                       env=_env(**launch), capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr and not (tmp_path / "out").exists()


def test_precheck_world_is_nnodes_x_ngpu(monkeypatch, capsys):
    debug = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_model.toml")]
    assert config.launch_world_size({"NNODES": "2", "NGPU": "8", "NODE_RANK": "1"}) == 16
    assert config.launch_world_size({}) == 1
    for bad, name in (({"NNODES": "0"}, "NNODES=0"), ({"NODE_RANK": "1"}, "NODE_RANK=1"),
                      ({"NGPU": "2.5"}, "NGPU=2.5"), ({"NNODES": "2", "NODE_RANK": "-1"}, "NODE_RANK=-1")):
        with pytest.raises(UserError, match=name):
            config.launch_world_size(bad)
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NGPU", "2")
    assert config._check_main([*debug, "--parallelism.data_parallel_shard_degree", "4"]) == 0
    assert config._check_main([*debug, "--parallelism.data_parallel_shard_degree", "2"]) == 2
    assert "NNODES x NGPU=2x2=4" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(dump):
    rows, _ = read_metrics(os.path.join(dump, "metrics.jsonl"))
    return [x["loss"] for x in rows], [x["grad_norm"] for x in rows]


@pytest.mark.slow
def test_two_hosts_bitwise_one_host(tmp_path, fsdp4_run):
    _, ref_loss, ref_norm = fsdp4_run  # NGPU=4 ./run_train.sh with FLAGS, one host
    assert len(ref_loss) == 2

    endpoint = f"127.0.0.1:{_free_port()}"
    procs = {}
    for node in (1, 0):  # NODE_RANK=1 first: a first-come rendezvous would make it rank 0
        procs[node] = subprocess.Popen(
            ["bash", "run_train.sh", *FLAGS, "--job.dump_folder", str(tmp_path / f"node{node}")], cwd=REPO,
            env=_env(NNODES="2", NODE_RANK=str(node), NGPU="2", RDZV_ENDPOINT=endpoint),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
    out = {}
    try:
        for node, p in procs.items():
            out[node] = p.communicate(timeout=900)[0]
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for node, p in procs.items():
        assert p.returncode == 0, f"node {node}:\n" + out[node][-3000:]
    assert "world 4" in out[0] and "world 4" in out[1]
    assert not (tmp_path / "node1" / "metrics.jsonl").exists()  # rank 0 is on NODE_RANK=0
    loss, norm = _metrics(tmp_path / "node0")
    assert loss == ref_loss and norm == ref_norm  # bitwise, every step
