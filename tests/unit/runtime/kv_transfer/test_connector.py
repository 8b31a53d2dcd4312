"""The KV connector seam (runtime/kv_transfer/connector.py) on a real block pool and a byte store
in place of the cache: transfer hashes (a partial last block never takes a prefix-cache hash), a
prefill leg's hold (taken on finish, released when every block was read or at the timeout, never
for an aborted or LoRA request), a decode leg's load plan (past the local hits, up to the last
prompt token, written by ``start_load_kv``). No model, no torch."""

from __future__ import annotations

from kvfleet.runtime.core.block_pool import BlockPool
from kvfleet.runtime.core.request import Request, RequestStatus
from kvfleet.runtime.kv_events.hashing import prompt_block_hashes
from kvfleet.runtime.kv_transfer.connector import KVConnectorBase, PeerPullConnector, transfer_hashes
from kvfleet.runtime.sampling_params import SamplingParams

BS = 4


class Access:
    """The cache as a dict: block id -> payload."""

    def __init__(self, num_blocks: int = 16) -> None:
        self.pool, self.block_size, self.cache = BlockPool(num_blocks), BS, {}

    def read(self, block_ids):
        return [self.cache.get(i, b"") for i in block_ids]

    def write(self, block_ids, payloads):
        self.cache.update(zip(block_ids, payloads))


def request(rid: str, n: int, params: dict | None, **kw) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1, kv_transfer_params=params), **kw)


def test_transfer_hashes_extend_the_prefix_chain_with_a_partial_block():
    tokens = list(range(10))
    hashes = transfer_hashes(tokens, BS)
    assert hashes[:2] == prompt_block_hashes(tokens, BS) and len(hashes) == 3
    assert hashes[2] not in transfer_hashes(list(range(12)), BS)  # the partial block hashes as partial
    assert transfer_hashes(tokens[:8], BS) == prompt_block_hashes(tokens[:8], BS)


def test_a_prefill_leg_holds_its_blocks_until_read_or_timeout():
    now = [100.0]
    access = Access()
    conn = PeerPullConnector(access, hold_timeout=5, clock=lambda: now[0])
    blocks = access.pool.get_new_blocks(3)
    access.write([b.block_id for b in blocks], [b"a", b"b", b"c"])
    req = request("p", 10, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_LENGTH
    held, params = conn.request_finished(req, blocks)
    assert held and params["remote_block_ids"] == [b.block_id for b in blocks] and params["expires_at"] == 105
    assert conn.finished_params["p"] is params and params["do_remote_prefill"]
    access.pool.free_blocks(blocks)  # the scheduler frees the request's own references
    assert access.pool.num_free_blocks == 13  # still held
    hashes = transfer_hashes(req.prompt_token_ids, BS)
    assert conn.export(hashes[:2]) == [(hashes[0], b"a"), (hashes[1], b"b")] and conn.num_held_blocks == 3
    assert conn.export(hashes[2:]) == [(hashes[2], b"c")]
    assert conn.num_held_blocks == 0 and access.pool.num_free_blocks == 16  # read whole: released
    # unread: released at the timeout
    blocks = access.pool.get_new_blocks(3)
    conn.request_finished(req, blocks)
    access.pool.free_blocks(blocks)
    now[0] += 5
    assert conn.export(hashes[2:]) == [] and access.pool.num_free_blocks == 16
    # two holds of one prompt: once the first is read, the second serves its own blocks
    first, second = access.pool.get_new_blocks(3), access.pool.get_new_blocks(3)
    access.write([b.block_id for b in second], [b"x", b"y", b"z"])
    for rid, blocks in (("p1", first), ("p2", second)):
        req.request_id = rid
        conn.request_finished(req, blocks)
        access.pool.free_blocks(blocks)
    conn.export(hashes)
    assert conn.num_held_blocks == 3 and conn.export(hashes) == list(zip(hashes, [b"x", b"y", b"z"]))
    assert conn.num_held_blocks == 0 and access.pool.num_free_blocks == 16


def test_no_hold_without_do_remote_decode_for_aborts_or_adapters():
    access = Access()
    conn = PeerPullConnector(access)
    blocks = access.pool.get_new_blocks(3)
    for req, status in ((request("a", 10, None), RequestStatus.FINISHED_LENGTH),
                        (request("b", 10, {"do_remote_decode": True}), RequestStatus.FINISHED_ABORTED),
                        (request("c", 10, {"do_remote_decode": True}, cache_salt="s"), RequestStatus.FINISHED_LENGTH)):
        req.status = status
        assert conn.request_finished(req, blocks) == (False, None)
    assert conn.num_held_blocks == 0 and not conn.finished_params
    assert KVConnectorBase().get_num_new_matched_tokens(req, 0) == 0  # the base class loads nothing


def test_a_decode_leg_loads_past_its_hits_up_to_the_last_prompt_token():
    access = Access()
    conn = PeerPullConnector(access)
    req = request("d", 10, {"do_remote_prefill": True})
    assert conn.get_num_new_matched_tokens(req, 0) == 0  # nothing fetched
    conn.set_fetched("d", [b"0", b"1", b"2"])
    assert conn.get_num_new_matched_tokens(req, 0) == 9  # the 10th token is computed (its logits)
    assert conn.get_num_new_matched_tokens(req, 4) == 5  # one block was a local hit
    conn.update_state_after_alloc(req, [7, 8, 9], 5)
    assert access.cache == {}  # written before the step's forward, not at admission
    conn.start_load_kv()
    assert access.cache == {8: b"1", 9: b"2"}
    assert conn.get_num_new_matched_tokens(req, 4) == 0  # consumed: a preempted request recomputes
