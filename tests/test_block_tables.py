"""Block tables kept on the device between steps (engine.attention.block_tables): a step
uploads only the entries its sequences add, and the tables the kernels read are always the
sequences' whole tables, through growth, replaced tables, eviction and anonymous tables."""

from __future__ import annotations

import random

import numpy as np
import torch

from engine.attention.block_tables import DeviceBlockTables


def _step(dt: DeviceBlockTables, tables, used, ids, capacity=4096):
    pairs = np.zeros((capacity, 2), dtype=np.int32)
    have = np.asarray([len(t) for t in tables], dtype=np.int64)
    rows, count = dt.stage(tables, np.asarray(used, dtype=np.int64), have, ids, pairs)
    out = torch.full((max(len(tables), 1), dt.width), -7, dtype=torch.int32)
    before = dt.entries_staged
    dt.apply(torch.from_numpy(pairs), count, torch.from_numpy(rows.astype(np.int32)), out)
    for i, (t, u) in enumerate(zip(tables, used)):
        assert out[i, :u].tolist() == list(t[:u]), i
        assert dt.host[rows[i], :u].tolist() == list(t[:u])
    return count, before


def test_a_decode_uploads_only_the_blocks_it_adds():
    dt = DeviceBlockTables(rows=4, width=64, device=torch.device("cpu"))
    tables = [list(range(100 + 10 * s, 100 + 10 * s + 5)) for s in range(3)]
    count, _ = _step(dt, tables, [5, 5, 5], [0, 1, 2])
    assert count == 15                                   # new to the device: whole
    count, _ = _step(dt, tables, [5, 5, 5], [0, 1, 2])
    assert count == 0                                    # nothing added
    tables[1].append(999)
    count, _ = _step(dt, tables, [5, 6, 5], [0, 1, 2])
    assert count == 1                                    # one block boundary crossed
    # a table of the same request, after preemption, under a new id: written whole
    tables[0] = [7, 8]
    count, _ = _step(dt, tables, [2, 6, 5], [3, 1, 2])
    assert count == 2


def test_random_steps_through_eviction_growth_and_anonymous_tables():
    rng = random.Random(5)
    dt = DeviceBlockTables(rows=3, width=32, device=torch.device("cpu"))
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(300):
        if len(live) < 12 and rng.random() < 0.3:
            live[next_id] = [rng.randrange(1000) for _ in range(rng.randint(1, 4))]
            next_id += 1
        if live and rng.random() < 0.1:
            del live[rng.choice(list(live))]
        for t in live.values():
            if len(t) < 32 and rng.random() < 0.3:
                t.append(rng.randrange(1000))
        if not live:
            continue
        ids = rng.sample(list(live), rng.randint(1, min(len(live), 8)))
        tables = [live[i] for i in ids]
        used = [rng.randint(1, len(t)) for t in tables]
        anonymous = rng.random() < 0.1
        _step(dt, tables, used, None if anonymous else ids)
    assert dt.rows >= 8                                 # grew to one step's sequences


def test_more_entries_than_staged_is_refused_before_anything_changes():
    dt = DeviceBlockTables(rows=2, width=16, device=torch.device("cpu"))
    pairs = np.zeros((4, 2), dtype=np.int32)
    tables = [list(range(10))]
    try:
        dt.stage(tables, np.asarray([10]), np.asarray([10]), [0], pairs)
    except ValueError as exc:
        assert "10 block-table entries exceed the 4 staged" in str(exc)
    else:
        raise AssertionError("accepted")
    _step(dt, tables, [10], [0])                        # then written whole
