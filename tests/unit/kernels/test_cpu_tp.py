"""Tensor parallelism inside the fused C step (kernels/cpu_tp.h, kvfleet.kernels.cpu_tp): two real
processes over gloo, each stepping its shard of a random decoder (its query and KV heads of q|k|v
and of the caches, its MLP channels of gate|up, the matching input columns of o and down), with
the all-reduce callback summing o's and down's partial outputs. For every matmul kind this CPU has:
the two shards give the whole decoder's hidden states (float32 sums in another order: within
1e-4), a row gives the same bits alone and in a batch, and a failed all-reduce stops the step
with TensorParallelStepError on both ranks (no hang). One rank with the callback (a group of one)
gives the plain step's bits exactly."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from kvfleet.kernels import cpu_woq
from kvfleet.kernels.cpu_decoder import MATMULS, DecoderWeights, FusedDecoder, Layer, Linear, matmul_available

pytestmark = pytest.mark.skipif(not cpu_woq.available(), reason="AVX2/FMA kernels unavailable here")

H, QH, KVH, D, FF, BS, BLOCKS, M = 64, 4, 2, 32, 128, 16, 32, 5
KINDS = [k for k in MATMULS if matmul_available(k)]


def _full(seed: int = 0):
    """A random 2-layer decoder (fp32 weights, no head) as lists of whole tensors."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(2):
        layers.append(dict(
            qkv=torch.randn((QH + 2 * KVH) * D, H, generator=gen) * 0.2, o=torch.randn(H, QH * D, generator=gen) * 0.2,
            gate_up=torch.randn(2 * FF, H, generator=gen) * 0.2, down=torch.randn(H, FF, generator=gen) * 0.2,
            n1=1 + 0.1 * torch.randn(H, generator=gen), n2=1 + 0.1 * torch.randn(H, generator=gen),
            k=torch.randn(BLOCKS, BS, KVH, D, generator=gen), v=torch.randn(BLOCKS, BS, KVH, D, generator=gen)))
    return layers, 1 + 0.1 * torch.randn(H, generator=gen)


def _shard(layer: dict, rank: int, world: int) -> dict:
    """Rank ``rank``'s shard, as transformers' colwise / rowwise plan cuts it."""
    qh, kvh, ff = QH // world, KVH // world, FF // world
    q = layer["qkv"][rank * qh * D:(rank + 1) * qh * D]
    k = layer["qkv"][(QH + rank * kvh) * D:(QH + (rank + 1) * kvh) * D]
    v = layer["qkv"][(QH + KVH + rank * kvh) * D:(QH + KVH + (rank + 1) * kvh) * D]
    gate = layer["gate_up"][rank * ff:(rank + 1) * ff]
    up = layer["gate_up"][FF + rank * ff:FF + (rank + 1) * ff]
    return dict(qkv=torch.cat([q, k, v]), o=layer["o"][:, rank * qh * D:(rank + 1) * qh * D],
                gate_up=torch.cat([gate, up]), down=layer["down"][:, rank * ff:(rank + 1) * ff], n1=layer["n1"],
                n2=layer["n2"], k=layer["k"][:, :, rank * kvh:(rank + 1) * kvh],
                v=layer["v"][:, :, rank * kvh:(rank + 1) * kvh])


def _decoder(layers: list[dict], final: torch.Tensor, heads: int, kv_heads: int, matmul: str,
             all_reduce=None) -> FusedDecoder:
    built = [Layer(t["n1"], t["n2"], *(Linear("fp32", t[n].contiguous()) for n in ("qkv", "o", "gate_up", "down")),
                   t["k"].contiguous(), t["v"].contiguous()) for t in layers]
    weights = DecoderWeights(heads, kv_heads, D, 1e-5, D ** -0.5, built, final, None)
    return FusedDecoder(weights, threads=1, matmul=matmul, all_reduce=all_reduce)


def _inputs(rows: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 5 * BS, (rows,), generator=gen, dtype=torch.int32)
    tables = torch.randperm(BLOCKS, generator=gen)[: rows * 6].view(rows, 6).to(torch.int32)  # disjoint per row
    slots = torch.tensor([int(tables[i, (n - 1) // BS]) * BS + (n - 1) % BS for i, n in enumerate(lens.tolist())])
    angles = (lens - 1).double()[:, None] / (10000 ** (torch.arange(0, D, 2).double() / D))
    angles = torch.cat([angles, angles], -1)
    return torch.randn(rows, H, generator=gen), angles.cos().float(), angles.sin().float(), slots, tables, lens


def _restore(decoder: FusedDecoder, snapshot) -> None:
    for layer, (k, v) in zip(decoder.weights.layers, snapshot):
        layer.k_cache.copy_(k)
        layer.v_cache.copy_(v)


def _worker(rank: int, world: int, store_path: str, kinds: list[str]) -> None:
    import torch.distributed as dist

    from kvfleet.kernels.cpu_tp import AllReduce, TensorParallelStepError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    solo = dist.new_group([0])
    try:
        x, cos, sin, slots, tables, lens = _inputs(M)
        for kind in kinds:
            layers, final = _full()
            whole = _decoder([dict(t, k=t["k"].clone(), v=t["v"].clone()) for t in layers], final, QH, KVH, kind)
            expected, _ = whole.step(x.clone(), cos, sin, slots, tables, lens)
            shard = _decoder([_shard(t, rank, world) for t in layers], final, QH // world, KVH // world, kind,
                             AllReduce())
            snapshot = [(lay.k_cache.clone(), lay.v_cache.clone()) for lay in shard.weights.layers]
            got, _ = shard.step(x.clone(), cos, sin, slots, tables, lens)
            assert shard.matmul == whole.matmul == kind
            assert shard.all_reduce.calls == 4  # o and down of 2 layers
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"{kind}: shards != whole decoder")
            for i in range(M):  # batch invariance within tensor parallelism
                _restore(shard, snapshot)
                alone, _ = shard.step(x[i:i + 1].clone(), cos[i:i + 1], sin[i:i + 1], slots[i:i + 1],
                                      tables[i:i + 1], lens[i:i + 1])
                assert torch.equal(alone[0], got[i]), f"{kind}: row {i} differs alone under tensor parallelism"
            if rank == 0:  # a group of one: the callback path gives the plain step's bits
                plain = _decoder([dict(t, k=t["k"].clone(), v=t["v"].clone()) for t in layers], final, QH, KVH, kind,
                                 AllReduce(solo))
                one, _ = plain.step(x.clone(), cos, sin, slots, tables, lens)
                assert torch.equal(one, expected), f"{kind}: a one-rank all-reduce changed the bits"
        failing = AllReduce()

        def broken(t):
            raise ConnectionError("peer gone")

        failing.reduce = broken
        layers, final = _full()
        shard = _decoder([_shard(t, rank, world) for t in layers], final, QH // world, KVH // world, "float32",
                         failing)
        try:
            shard.step(x.clone(), cos, sin, slots, tables, lens)
        except TensorParallelStepError as exc:
            assert isinstance(exc.__cause__, ConnectionError)
        else:
            raise AssertionError("a failed all-reduce did not stop the step")
        shard.all_reduce.reduce = lambda t: None   # the decoder steps again afterwards (state reset)
        shard.step(x.clone(), cos, sin, slots, tables, lens)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_step_their_shards_as_the_whole_decoder(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), KINDS), nprocs=2, join=True)
