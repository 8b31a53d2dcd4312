"""``kvfleet serve`` across two "nodes" on 127.0.0.1, launched with vLLM's multi-node flags
(``--nnodes 2 --node-rank R --master-addr --master-port``, node 1 ``--headless``): tensor
parallelism 2 answers as one process does, a killed worker node makes the leader exit 1
within seconds, the reason in its termination log, a stopped leader stops its worker node
cleanly, and a worker node with other options fails the leader's start naming them. Both processes are real ``kvfleet serve``
processes; the model is the default one cut to 2 layers and 4 attention heads (4 KV heads), so
that 2 and 4 ranks divide it (2 nodes x 1 rank, 2 nodes x 2 ranks). Rank layout and liveness: runtime/worker/multinode.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.netns import TwoNodes, two_nodes
from support.procfs import wait_gone, worker_pids
from support.serve import free_port, start_serve, stop_serve

from kvfleet.runtime.config import EngineConfig
from kvfleet.runtime.engine.llm_engine import LLMEngine
from kvfleet.runtime.sampling_params import SamplingParams

PROMPT = "The capital of France is"
MAX_TOKENS = 8
COMMON = ["--nnodes", "2", "--master-addr", "127.0.0.1",
          "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "32MiB", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def four_head_checkpoint(smollm2, tmp_path_factory) -> Path:
    """SmolLM2-135M's first 2 layers with 4 of its 9 query heads (0, 1, 3, 4) and, for each, a
    copy of the KV head it reads (0, 0, 1, 1): real weights, the same attention per kept head
    (head_dim stays 64), 4 query and 4 KV heads, so that 2 and 4 ranks divide it."""
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("smollm2-2l-4h")
    model = AutoModelForCausalLM.from_pretrained(smollm2.source, num_hidden_layers=2, dtype=torch.float32)
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    q_heads, kv_heads = [0, 1, 3, 4], [0, 0, 1, 1]

    def rows(heads: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in heads])

    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj, heads in ((attn.q_proj, q_heads), (attn.k_proj, kv_heads), (attn.v_proj, kv_heads)):
                proj.weight = torch.nn.Parameter(proj.weight[rows(heads)].clone())
                proj.out_features = len(heads) * hd
            attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight[:, rows(q_heads)].clone())
            attn.o_proj.in_features = len(q_heads) * hd
    cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads = hd, 4, 4
    model.save_pretrained(path)
    smollm2.tokenizer.save_pretrained(path)
    del model
    return path


def _reference(path: Path) -> str:
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", kv_cache_memory=32 * 2**20))
    engine.add_request("ref", PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    out = engine.run_until_done()["ref"].outputs[0]
    assert len(out.token_ids) == MAX_TOKENS  # no early EOS: the comparison covers every step
    return out.text


def _start_headless(path: Path, port: int, log: Path, tp: int = 2, pp: int = 1,
                    net: TwoNodes | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--model", str(path), *_common(net),
           "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
           "--master-port", str(port), "--node-rank", "1", "--headless"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1", "TOKENIZERS_PARALLELISM": "false"}
    if net is not None:  # node 1 in its own network namespace, its ranks on its end of the link
        cmd, env["GLOO_SOCKET_IFNAME"] = [*net.worker_prefix, *cmd], net.worker_ifname
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)


def _common(net: TwoNodes | None) -> list[str]:
    """COMMON, with node 0's address on the link between the namespaces when there is one."""
    return COMMON if net is None else [net.leader_addr if a == "127.0.0.1" else a for a in COMMON]


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "pp", "ending", "netns"), [(2, 1, "kill_node", False), (2, 1, "stop_leader", False),
                                                           (4, 1, "kill_node", False), (1, 2, "kill_node", False),
                                                           (2, 2, "kill_node", True)])
def test_tp_over_two_nodes_answers_as_one_process(tp, pp, ending, netns, four_head_checkpoint, tmp_path):
    with two_nodes() if netns else contextlib.nullcontext() as net:
        if netns and net is None:
            print("no network namespace here (needs root and iproute2): node 1 runs on 127.0.0.1")
        _two_nodes(tp, pp, ending, net, four_head_checkpoint, tmp_path)


def _two_nodes(tp: int, pp: int, ending: str, net: TwoNodes | None, four_head_checkpoint: Path, tmp_path: Path):
    """Greedy text over 2 nodes x ``tp*pp/2`` ranks equals the one-process engine's: tensor
    parallelism across the nodes, pipeline parallelism (one stage, one layer, per node) and both
    (each node a stage of 2 tensor-parallel ranks: rank 2 on node 1 gets its hidden state from
    rank 0, rank 3 from rank 1; node 1 in its own network namespace, the ranks over a veth link,
    where the test can make one: ``netns``). Then ``kill_node``:
    SIGKILL of the headless node makes the leader exit 1 within seconds (its engine loop sees
    the lost heartbeat while idle), the reason in the termination log; ``stop_leader``: SIGTERM
    of the leader stops the headless node too, both cleanly (its rank exits 0)."""
    path = four_head_checkpoint
    expected = _reference(path)
    port = free_port()
    worker_log, leader_log, term_log = tmp_path / "node1.log", tmp_path / "node0.log", tmp_path / "termination-log"
    worker = _start_headless(path, port, worker_log, tp, pp, net)
    world = tp * pp
    leader = None
    try:
        leader, base = start_serve(["--model", str(path), *_common(net), "--tensor-parallel-size", str(tp), "-pp",
                                    str(pp), "--master-port", str(port), "--node-rank", "0",
                                    "--termination-log", str(term_log), "--log-level", "info"], leader_log,
                                   env=None if net is None else {"GLOO_SOCKET_IFNAME": net.leader_ifname})
        assert worker.poll() is None, worker_log.read_text()
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        resp = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected, (resp.json(), expected)
        assert f"this node runs ranks {list(range(world // 2))}" in leader_log.read_text()
        node1_children = worker_pids(worker.pid)  # the headless node's own extra ranks (4 ranks: rank 3)
        assert len(node1_children) == world // 2 - 1, node1_children

        if ending == "stop_leader":
            leader.send_signal(signal.SIGTERM)
            assert leader.wait(60) == -signal.SIGTERM, leader_log.read_text()
            assert worker.wait(30) == 0, worker_log.read_text()
            assert not term_log.exists() or not term_log.read_text(), term_log.read_text()
            return
        print(f"SIGKILL of the headless node at {time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d}")
        worker.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        worker.wait(10)
        code = leader.wait(30)
        elapsed = time.monotonic() - t0
        log = leader_log.read_text()
        assert code == 1, log
        assert elapsed < 15, f"the leader took {elapsed:.1f} s to exit:\n{log}"
        lost = re.search(r"rank (\d+): no heartbeat", term_log.read_text())  # whichever of node 1's is seen first
        assert lost and world // 2 <= int(lost.group(1)) < world, term_log.read_text()
        assert wait_gone(node1_children, 10), f"ranks {node1_children} outlived their node"
        print(f"leader exited {code} {elapsed:.2f} s after SIGKILL of the headless node")
    finally:
        if leader is not None:
            stop_serve(leader)
        if worker.poll() is None:
            worker.kill()
            worker.wait()


@pytest.mark.slow
def test_headless_node_with_other_options_fails_the_leader_naming_them(four_head_checkpoint, tmp_path):
    """A headless node whose ``--model`` differs from the leader's: the node exits 2 and the leader fails its start (status 1) naming the option,
    instead of waiting for a rank that never joins."""
    port = free_port()
    worker = _start_headless(Path(str(four_head_checkpoint) + "-other"), port, tmp_path / "node1.log")
    cmd = [sys.executable, "-m", "kvfleet.runtime.cli", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--model", str(four_head_checkpoint), *COMMON, "--tensor-parallel-size", "2", "--master-port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        leader = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert worker.wait(30) == 2, (tmp_path / "node1.log").read_text()
        assert leader.returncode == 1, leader.stderr
        assert "options differ from node 0's (model:" in leader.stderr, leader.stderr[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
