"""The KV tiers' bytes (model/kv_tier_store.py): block files and their checks, the setting key
that keeps another model's or setting's files unread, and the store's copies between the
pools, RAM slots and disk, with its reports on what failed."""

import errno
import os

import pytest
import torch

from iterserve.core.scheduler_output import KVTierOps
from iterserve.model.config import ModelConfig
from iterserve.model.kv_cache import PagedKVCache
from iterserve.model.kv_tier_store import (
    CorruptBlockError, DiskStore, KVTierStore, block_file_bytes, setting_key)

D1, D2 = "ab" * 32, "cd" * 32


def small_config(**kw):
    cfg = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                               "intermediate_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2,
                               "max_position_embeddings": 128, **kw}, torch.float32)
    return cfg


def cache(num_blocks=4, tier=4, dtype=torch.float32):
    return PagedKVCache(small_config(), num_blocks=num_blocks, block_size=4, dtype=dtype,
                        num_tier_blocks=tier)


def store_for(kv, tmp_path, key="k"):
    return DiskStore(tmp_path, key, kv.block_shape, kv.dtype)


def fill(kv, block, value):
    kv.block_view(block).copy_(torch.full(kv.block_shape, float(value)))


# --- block files ---------------------------------------------------------------------------
def test_a_block_file_round_trips_and_has_the_size_the_bound_counts(tmp_path):
    kv = cache()
    ds = store_for(kv, tmp_path)
    data = torch.randn(kv.block_shape)
    ds.write(D1, memoryview(data.numpy()).cast("B"))
    assert ds.exists(D1) and os.path.getsize(ds.path(D1)) == ds.file_bytes
    payload = bytes(ds.read(D1))
    assert torch.equal(torch.frombuffer(bytearray(payload), dtype=torch.float32)
                       .view(kv.block_shape), data)
    assert ds.scan() == [D1]


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[:len(b) // 2], "torn"),                                    # a torn write
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "payload checksum"),            # a flipped bit
    (lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], "header checksum"),    # in the header
    (lambda b: b"NOTABLOCK" + b[9:], "not a block file"),
    (lambda b: b[:10], "torn"),
])
def test_damaged_files_are_detected_never_read_as_data(tmp_path, damage, match):
    kv = cache()
    ds = store_for(kv, tmp_path)
    ds.write(D1, memoryview(torch.randn(kv.block_shape).numpy()).cast("B"))
    path = ds.path(D1)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CorruptBlockError, match=match):
        ds.read(D1)


def test_a_file_of_another_setting_or_block_is_refused_by_its_header(tmp_path):
    kv = cache()
    a = store_for(kv, tmp_path, key="model A")
    b = store_for(kv, tmp_path, key="model B")
    assert a.dir != b.dir                           # another directory in the first place
    a.write(D1, memoryview(torch.randn(kv.block_shape).numpy()).cast("B"))
    b.path(D1).parent.mkdir(parents=True, exist_ok=True)
    os.replace(a.path(D1), b.path(D1))              # moved by hand into B's directory
    with pytest.raises(CorruptBlockError, match="another model"):
        b.read(D1)
    b.path(D2).parent.mkdir(exist_ok=True)
    os.replace(b.path(D1), b.path(D2))              # renamed to another block's digest
    b.key = a.key                                   # (even with the right setting)
    with pytest.raises(CorruptBlockError, match="another model"):
        b.read(D2)
    with pytest.raises(FileNotFoundError):
        b.read(D1)


def test_scan_orders_by_last_use_and_removes_a_crashed_writers_temporary_files(tmp_path):
    kv = cache()
    ds = store_for(kv, tmp_path)
    for d in (D1, D2):
        ds.write(d, memoryview(torch.zeros(kv.block_shape).numpy()).cast("B"))
    os.utime(ds.path(D2), (1, 1))                   # D2 last used long ago
    stale = ds.path(D1).with_name(D1 + ".kv.123.456.tmp")
    stale.write_bytes(b"half a block")
    os.utime(stale, (1, 1))
    fresh = ds.path(D1).with_name(D1 + ".kv.999.1.tmp")   # a live writer's: left alone
    fresh.write_bytes(b"in progress")
    assert ds.scan() == [D2, D1]
    assert not stale.exists() and fresh.exists()


def test_the_setting_key_changes_with_the_model_file_dtypes_and_block_size(tmp_path):
    from fixtures.tiny_models import make_tiny_model_dir
    from iterserve.model.loader import load_model
    a = load_model(str(make_tiny_model_dir(tmp_path / "a", seed=0)))
    b = load_model(str(make_tiny_model_dir(tmp_path / "b", seed=1)))   # same shape, other weights
    kw = dict(block_size=16, kv_dtype=torch.float32, kernel_activations="auto", device="cpu")
    key = setting_key(a, **kw)
    assert key == setting_key(a, **kw)
    assert setting_key(b, **kw) != key
    assert setting_key(a, **{**kw, "block_size": 8}) != key
    assert setting_key(a, **{**kw, "kv_dtype": torch.float16}) != key
    assert setting_key(a, **{**kw, "kernel_activations": "int8"}) != key
    st = os.stat(a.path + "/model.safetensors")
    os.utime(a.path + "/model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert setting_key(a, **kw) != key              # the file was rewritten
    assert block_file_bytes(key, a.config, 16) == DiskStore(
        tmp_path / "kv", key, (2, a.config.num_layers, 16, a.config.num_kv_heads,
                               a.config.head_dim), torch.float32).file_bytes


# --- the store's copies --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_block_goes_to_ram_to_disk_and_back_into_another_block(tmp_path, dtype):
    kv = cache(dtype=dtype)
    store = KVTierStore(kv, store_for(kv, tmp_path))
    try:
        src = torch.randn(kv.block_shape).to(dtype)
        kv.block_view(0).copy_(src)
        slot = kv.num_swap_blocks            # the RAM tier's first slot
        store.save_and_read(KVTierOps(ram_saves=[(0, slot)], disk_saves=[(0, D1)]))
        fill(kv, 0, 0)                       # the pool reuses the block at once
        assert store.flush()
        assert torch.equal(kv.host_view(slot), src)
        store.save_and_read(KVTierOps(disk_reads=[(D1, slot + 1)]))
        bad, (seconds, n) = store.load(KVTierOps(ram_loads=[(slot + 1, 2), (slot, 3)]))
        assert bad == set() and n == 2
        assert torch.equal(kv.block_view(2), src) and torch.equal(kv.block_view(3), src)
        fb = store.feedback()
        assert fb.failed_reads == [] and fb.load_s["disk"][1] == 1
    finally:
        store.close()


def test_a_read_of_a_block_still_queued_for_writing_comes_from_the_queue(tmp_path):
    kv = cache()
    ds = store_for(kv, tmp_path)
    store = KVTierStore(kv, ds)
    gate = __import__("threading").Event()
    real = ds.write
    ds.write = lambda d, p: (gate.wait(10), real(d, p))
    try:
        fill(kv, 1, 7)
        store.save_and_read(KVTierOps(disk_saves=[(1, D1)], disk_reads=[(D1, 3)]))
        bad, _ = store.load(KVTierOps(ram_loads=[(3, 0)]))
        assert bad == set() and torch.all(kv.block_view(0) == 7)
    finally:
        gate.set()
        store.close()


def test_a_corrupt_or_missing_file_leaves_its_slot_bad_and_its_loads_reported(tmp_path, caplog):
    kv = cache()
    ds = store_for(kv, tmp_path)
    store = KVTierStore(kv, ds)
    try:
        fill(kv, 0, 3)
        store.save_and_read(KVTierOps(disk_saves=[(0, D1)]))
        assert store.flush()
        path = ds.path(D1)
        path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)
        store.save_and_read(KVTierOps(disk_reads=[(D1, 2), (D2, 3)]))   # D2 never written
        bad, _ = store.load(KVTierOps(ram_loads=[(2, 1), (3, 2)]))
        assert bad == {1, 2}
        fb = store.feedback()
        assert sorted(fb.failed_reads) == sorted([(D1, 2), (D2, 3)])
        assert not path.exists()                            # a corrupt file is removed
        assert "checksum" in caplog.text
        store.save_and_read(KVTierOps(ram_saves=[(0, 2)]))  # a good copy heals the slot
        assert store.load(KVTierOps(ram_loads=[(2, 1)]))[0] == set()
    finally:
        store.close()


def test_a_full_disk_fails_writes_without_failing_the_step(tmp_path, caplog):
    kv = cache()
    ds = store_for(kv, tmp_path)

    def full(digest, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    ds.write = full
    store = KVTierStore(kv, ds)
    try:
        store.save_and_read(KVTierOps(disk_saves=[(0, D1), (1, D2)]))
        assert store.flush()
        fb = store.feedback()
        assert sorted(fb.failed_writes) == [D1, D2]
        assert "No space left" in caplog.text and caplog.text.count("No space left") == 1
        assert store.stats()["write_failures"] == 2
    finally:
        store.close()


def test_a_writer_too_far_behind_drops_blocks_instead_of_holding_memory(tmp_path):
    kv = cache()
    ds = store_for(kv, tmp_path)
    gate = __import__("threading").Event()
    real = ds.write
    ds.write = lambda d, p: (gate.wait(10), real(d, p))
    store = KVTierStore(kv, ds, max_pending_write_bytes=2 * ds.payload_bytes)
    try:
        store.save_and_read(KVTierOps(disk_saves=[(0, "0" * 64), (1, "1" * 64),
                                                  (2, "2" * 64)]))
        assert store.feedback().failed_writes == ["2" * 64]
    finally:
        gate.set()
        store.close()
    assert ds.scan() and len(ds.scan()) == 2
