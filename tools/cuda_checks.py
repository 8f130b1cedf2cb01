"""GPU-only checks of the CUDA kernels against the CPU kernels (run on a GPU machine).

    python tools/cuda_checks.py

Needs veloce built with both CPU and CUDA kernels. Each check prints one line; the
script exits non-zero on the first failure. What it checks beyond the shared tests:
concurrency (the same new ids inserted from many blocks at once), CPU/CUDA agreement on
tables too large for the unit tests, bit-identical rollback, eviction invariants, and
bitwise-deterministic accumulate_grad.
"""

from __future__ import annotations

import sys

import torch

import veloce  # noqa: F401

ops = torch.ops.veloce
dev = torch.device("cuda")
G = torch.Generator().manual_seed(0)


def table(capacity: int, dim: int, device, dtype=torch.float32, S: int = 0):
    return [
        torch.zeros(capacity, dtype=torch.long, device=device),
        torch.zeros(capacity, dtype=torch.uint8, device=device),
        torch.zeros(capacity, dtype=torch.long, device=device),
        torch.zeros(capacity, dim, dtype=dtype, device=device),
        torch.zeros(capacity, S, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device),
    ]


def as_dict(t):
    k, w, o, s = ops.export(*t, 0, t[0].numel())
    order = torch.argsort(k.cpu())
    return k.cpu()[order], w.cpu()[order], o.cpu()[order], s.cpu()[order]


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        sys.exit(1)


def rand_ids(n: int, lo: int = -(1 << 63), hi: int = (1 << 63) - 1) -> torch.Tensor:
    return torch.randint(lo, hi, (n,), generator=G, dtype=torch.long)


def same_table(a, b) -> bool:
    """Keys, scores and state exactly; initial rows to within an ulp (CUDA's double
    log/cos may differ from glibc's in the last bit before rounding to the row dtype)."""
    def same(x, y):
        x, y = x.cpu(), y.cpu()
        if not x.is_floating_point():
            return torch.equal(x, y)
        eps = torch.finfo(x.dtype).eps
        return x.shape == y.shape and torch.allclose(x.double(), y.double(), rtol=2 * eps, atol=2 * eps)
    return all(same(x, y) for x, y in zip(as_dict(a), as_dict(b)))


def main() -> None:
    # 1. find_or_insert CPU vs CUDA: same found sets, same rows, same scores (LFU), dups + padding.
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        cap, dim = 1 << 14, 24
        tc, tg = table(cap, dim, "cpu", dtype, 3), table(cap, dim, dev, dtype, 3)
        for step in range(4):
            ids = rand_ids(3000, -500, 4000)
            ids[::17] = 7  # padding
            rc = ops.find_or_insert(*tc, ids, 2, step, False, 5, 3, 0.1, 0.5, 7)
            rg = ops.find_or_insert(*tg, ids.to(dev), 2, step, False, 5, 3, 0.1, 0.5, 7)
            check(f"find_or_insert counts {dtype} step {step}", rc[1].tolist() == rg[1].cpu().tolist(),
                  f"{rc[1].tolist()} vs {rg[1].cpu().tolist()}")
            sg = rg[0].cpu()
            check("  padding/present positions agree", torch.equal(rc[0] >= 0, sg >= 0))
            check("  slots hold their ids", torch.equal(tg[0].cpu()[sg[sg >= 0]], ids[sg >= 0]))
        check(f"  tables equal as sets {dtype}", same_table(tc, tg))

    # 2. Concurrency: 4096 new ids each repeated 256 times, shuffled: exactly one row each.
    cap = 1 << 16
    tg = table(cap, 8, dev)
    base = rand_ids(4096)
    ids = base.repeat(256)[torch.randperm(4096 * 256, generator=G)].to(dev)
    slots, counts, _ = ops.find_or_insert(*tg, ids, 2, 1, False, 0, 1, 1.0, 0.0)
    check("concurrent same ids: 4096 inserted", counts.cpu().tolist() == [4096, 0], str(counts.cpu().tolist()))
    check("  occupancy 4096", int((tg[1] != 0).sum()) == 4096)
    check("  every copy maps to one slot", int(torch.unique(slots).numel()) == 4096)
    check("  LFU counts 256 each", bool((tg[2][slots] == 256).all()))
    again = ops.find(tg[0], tg[1], base.to(dev))
    check("  find agrees", bool((again >= 0).all()) and torch.equal(torch.sort(again)[0], torch.unique(slots)))

    # 3. Full table, no eviction: counts[1] > 0 and the table is bit-identical.
    cap = 1 << 10
    tc, tg = table(cap, 4, "cpu"), table(cap, 4, dev)
    fill = rand_ids(800)
    ops.insert_or_assign(*tc, fill, torch.randn(800, 4, generator=G), None, None, 1, 1, False)
    ops.insert_or_assign(*tg, fill.to(dev), torch.randn(800, 4, generator=G).to(dev), None, None, 1, 1, False)
    before = [x.clone() for x in tg]
    new = rand_ids(400)
    _, counts, ev = ops.find_or_insert(*tg, torch.cat([fill[:50], new]).to(dev), 1, 9, False, 0, 1, 1.0, 0.0)
    check("no room: failed > 0, nothing inserted", int(counts[0]) == 0 and int(counts[1]) > 0, str(counts.tolist()))
    check("  table bit-identical", all(torch.equal(a, b) for a, b in zip(before, tg)))
    _, counts_c, _ = ops.find_or_insert(*tc, torch.cat([fill[:50], new]), 1, 9, False, 0, 1, 1.0, 0.0)
    check("  same failure count as CPU", counts_c.tolist() == counts.cpu().tolist(), f"{counts_c.tolist()}")

    # 4. Eviction: all new ids placed, evicted keys were untouched, untouched lowest scores go first.
    tg = [x.clone() for x in before]
    tg[2].copy_(torch.arange(cap, device=dev))  # distinct scores
    batch = torch.cat([fill[:100], new]).to(dev)
    slots, counts, ev = ops.find_or_insert(*tg, batch, 1, 10**6, True, 0, 1, 1.0, 0.0)
    check("evict: all inserted", counts.cpu().tolist() == [400, 0], str(counts.cpu().tolist()))
    present = ops.find(tg[0], tg[1], batch)
    check("  whole batch present", bool((present >= 0).all()))
    check("  evicted keys not in batch", not bool(torch.isin(ev, batch).any()))
    check("  evicted keys gone", bool((ops.find(tg[0], tg[1], ev) < 0).all()))
    check("  size = before + inserted - evicted", int((tg[1] != 0).sum()) == 800 + 400 - ev.numel())

    # 5. insert_or_assign last-wins vs CPU, with opt_values and score_values.
    cap, dim, S = 1 << 12, 16, 2
    tc, tg = table(cap, dim, "cpu", S=S), table(cap, dim, dev, S=S)
    ids = rand_ids(2000, 0, 1500)
    vals = torch.randn(2000, dim, generator=G)
    ov = torch.randn(2000, S, generator=G)
    sv = torch.randint(0, 100, (2000,), generator=G)
    rc = ops.insert_or_assign(*tc, ids, vals, ov, sv, 1, 3, False)
    rg = ops.insert_or_assign(*tg, ids.to(dev), vals.to(dev), ov.to(dev), sv.to(dev), 1, 3, False)
    check("insert_or_assign counts", rc[1].tolist() == rg[1].cpu().tolist())
    check("  tables equal (last occurrence wins)", same_table(tc, tg))

    # 6. erase first-position mask vs CPU.
    er = torch.cat([ids[:300], rand_ids(100), ids[:50]])
    check("erase mask", torch.equal(ops.erase(tc[0], tc[1], er), ops.erase(tg[0], tg[1], er.to(dev)).cpu()))
    check("  tables equal after erase", same_table(tc, tg))

    # 7. pooled_lookup / accumulate_grad / sparse_update vs CPU (float32, odd and even dims).
    for D in (7, 64, 128):
        C, B = 5000, 700
        w = torch.randn(C, D, generator=G)
        extra = torch.randn(9, D, generator=G)
        lengths = torch.randint(0, 12, (B,), generator=G)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        N = int(lengths.sum())
        slots = torch.randint(-2, C + 9, (N,), generator=G)
        psw = torch.randn(N, generator=G)
        for mode, p in ((0, None), (1, None), (0, psw)):
            oc = ops.pooled_lookup(w, slots, offsets, p, mode, False, extra)
            og = ops.pooled_lookup(w.to(dev), slots.to(dev), offsets.to(dev), None if p is None else p.to(dev), mode,
                                   False, extra.to(dev)).cpu()
            check(f"pooled_lookup D={D} mode={mode} psw={p is not None}", torch.allclose(oc, og, atol=1e-5, rtol=1e-5),
                  f"max err {float((oc - og).abs().max()):.2e}")
            grad = torch.randn(B, D, generator=G)
            uc, gc = ops.accumulate_grad(grad, slots, offsets, p, mode, False, C)
            args = (grad.to(dev), slots.to(dev), offsets.to(dev), None if p is None else p.to(dev), mode, False, C)
            ug, gg = ops.accumulate_grad(*args)
            ug2, gg2 = ops.accumulate_grad(*args)
            check(f"accumulate_grad D={D} mode={mode}", torch.equal(uc, ug.cpu()) and
                  torch.allclose(gc, gg.cpu(), atol=1e-5, rtol=1e-5))
            check("  bitwise deterministic", torch.equal(gg, gg2) and torch.equal(ug, ug2))
        for opt, S in ((0, 0), (1, D), (2, 1), (3, 2 * D)):
            wc, st = w.clone(), torch.rand(C, S, generator=G)
            wg, sg = wc.to(dev), st.to(dev)
            us = torch.randperm(C, generator=G)[:1000]
            gr = torch.randn(1000, D, generator=G)
            ops.sparse_update(wc, st, us, gr, opt, 0.1, 1e-8, 0.9, 0.999, 0.01, 3)
            ops.sparse_update(wg, sg, us.to(dev), gr.to(dev), opt, 0.1, 1e-8, 0.9, 0.999, 0.01, 3)
            check(f"sparse_update opt={opt} D={D}", torch.allclose(wc, wg.cpu(), atol=1e-5, rtol=1e-5) and
                  torch.allclose(st, sg.cpu(), atol=1e-5, rtol=1e-5),
                  f"max err {float((wc - wg.cpu()).abs().max()):.2e}")

    # 8. Bad input: a clear error, no illegal memory access afterwards.
    try:
        ops.pooled_lookup(w.to(dev), torch.tensor([0, C + 100], device=dev), torch.tensor([0], device=dev), None, 0,
                          False, None)
        check("bad slot raises", False)
    except RuntimeError as e:
        check("bad slot raises", "slots[1]" in str(e), str(e).splitlines()[0][:100])
    try:
        ops.find(tg[0], tg[1], torch.tensor([1, 2]))
        check("device mismatch raises", False)
    except RuntimeError as e:
        check("device mismatch raises", "ids is on cpu but keys is on cuda" in str(e), str(e).splitlines()[0][:100])
    torch.cuda.synchronize()
    print("all CUDA checks passed")


if __name__ == "__main__":
    main()
