"""The compiled replay loop (numba): cache, prefetch and modeled timeline over access groups.

It performs exactly the calls the live runtime makes on :class:`~workbench.runtime.expert_cache.
ExpertCache` (lookup → LayerFill admissions → prefetch) and prices them the way
:class:`~workbench.runtime.clocks.ModeledClock` does, for the built-in eviction policies, with
array state instead of Python objects. ``engine.replay(..., engine="python")`` runs the same
sequence through the real policy objects; tests hold the two equal.

State per key (``layer · E + expert``): resident / protected / used-since-load / prefetched-
unused flags, transfer-ready time, policy state (LRU list, use counts, last use on the access
clock ``t``, hotness ring of use steps, Belady's pointer into the key's future groups).
"""

from __future__ import annotations

import numpy as np
from numba import njit

LRU, LFU, BELADY, HOTNESS = 0, 1, 2, 3
POLICY_CODES = {"lru": LRU, "lfu": LFU, "belady": BELADY, "hotness": HOTNESS}
RING = 64  # most hotness window steps the kernel keeps per key


@njit(cache=True, _nrt=False, error_model="numpy")
def _unlink(k, prev, nxt, head, tail, pool):
    p, n = prev[k], nxt[k]
    if p != -1:
        nxt[p] = n
    else:
        head[pool] = n
    if n != -1:
        prev[n] = p
    else:
        tail[pool] = p
    prev[k] = -1
    nxt[k] = -1


@njit(cache=True, _nrt=False, error_model="numpy")
def _push_head(k, prev, nxt, head, tail, pool):
    prev[k] = -1
    nxt[k] = head[pool]
    if head[pool] != -1:
        prev[head[pool]] = k
    head[pool] = k
    if tail[pool] == -1:
        tail[pool] = k


@njit(cache=True, _nrt=False, error_model="numpy")
def _touch(k, step, policy, count, ring, ring_n):
    """A use of ``k`` in ``step`` (policy state the kernel keeps only for the policy in use)."""
    if policy == LFU:
        count[k] += 1
    elif policy == HOTNESS:
        if ring_n[k] == 0 or ring[k, (ring_n[k] - 1) % RING] != step:
            ring[k, ring_n[k] % RING] = step
            ring_n[k] += 1


@njit(cache=True, _nrt=False, error_model="numpy")
def _hot_score(k, step, ring, ring_n, hot_pow, window):
    n = ring_n[k]
    lo = n
    while lo > max(0, n - RING) and step - ring[k, (lo - 1) % RING] < window:
        lo -= 1  # uses are at distinct, increasing steps: stop at the first one too old
    s = 0.0
    for j in range(lo, n):  # oldest first, as the Python policy sums
        s += hot_pow[step - ring[k, j % RING]]
    return s


@njit(cache=True, _nrt=False, error_model="numpy")
def _next_use(k, g, occ_ptr, occ_grp, optr):
    i = optr[k]
    end = occ_ptr[k + 1]
    while i < end and occ_grp[i] <= g:
        i += 1
    optr[k] = i
    if i < end:
        return occ_grp[i]
    return 1 << 62


def simulate(g_layer, g_step, g_ptr, acc_key, g_dense, acc_comp, layer_pinned, pool_of_layer,
             pool_cap, policy, hot_pow, window, occ_ptr, occ_grp, pf_ptr, pf_key, xfer_time,
             num_keys, num_experts, num_steps, num_layers):
    """Allocate the state, run :func:`_simulate` (compiled without numba's reference counting,
    whose atomic increments on every array passed to a helper cost ~85 % of the time)."""
    G = g_layer.shape[0]
    P = pool_cap.shape[0]
    maxcap = max(1, int(pool_cap.max())) if P else 1
    B = lambda: np.zeros(num_keys, np.bool_)  # noqa: E731
    state = dict(
        resident=B(), protected=B(), is_miss=B(), used=B(), pref=B(),
        ready=np.zeros(num_keys, np.float64),
        prev=np.full(num_keys, -1, np.int64), nxt=np.full(num_keys, -1, np.int64),
        head=np.full(P, -1, np.int64), tail=np.full(P, -1, np.int64), occ=np.zeros(P, np.int64),
        res_list=np.full((P, maxcap), -1, np.int64), pos=np.full(num_keys, -1, np.int64),
        last_use=np.full(num_keys, -1, np.int64), count=np.zeros(num_keys, np.int64),
        ring=np.zeros((num_keys, RING), np.int64), ring_n=np.zeros(num_keys, np.int64),
        optr=occ_ptr[:-1].copy())
    out = dict(
        hits=np.zeros(G, np.int64), misses=np.zeros(G, np.int64),
        pf_loads=np.zeros(G, np.int64), pf_hits=np.zeros(G, np.int64),
        stall=np.zeros(G, np.float64), g_end=np.zeros(G, np.float64),
        evict_sl=np.zeros(num_steps * num_layers, np.int64),
        redundant_sl=np.zeros(num_steps * num_layers, np.int64))
    # γ^age for age < window, computed by Python's float pow like the policy class does, so
    # that both sum identical terms in the same order (ties then break the same way)
    hot_pow = np.array([hot_pow ** a for a in range(max(int(window), 1))], np.float64)
    n = max(1, num_experts)
    bufs = (np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.float64))
    unused = _simulate(g_layer, g_step, g_ptr, acc_key, g_dense, acc_comp, layer_pinned,
                       pool_of_layer, pool_cap, policy, hot_pow, window, occ_ptr, occ_grp, pf_ptr,
                       pf_key, xfer_time, num_experts, num_layers, *state.values(),
                       *out.values(), *bufs)
    return (out["hits"], out["misses"], out["pf_loads"], out["pf_hits"], out["stall"],
            out["g_end"], out["evict_sl"], out["redundant_sl"], int(unused))


@njit(cache=True, _nrt=False, error_model="numpy")
def _simulate(g_layer, g_step, g_ptr, acc_key, g_dense, acc_comp, layer_pinned, pool_of_layer,
              pool_cap, policy, hot_pow, window, occ_ptr, occ_grp, pf_ptr, pf_key, xfer_time,
              num_experts, num_layers, resident, protected, is_miss, used, pref, ready, prev,
              nxt, head, tail, occ, res_list, pos, last_use, count, ring, ring_n, optr, hits,
              misses, pf_loads, pf_hits, stall, g_end, evict_sl, redundant_sl, miss_buf, adm_buf,
              miss_comp):
    G = g_layer.shape[0]
    num_keys = resident.shape[0]
    t = 0  # the cache's access clock (ExpertCache.t)
    now = 0.0  # modeled compute lane
    xfer_free = 0.0  # modeled transfer lane

    for g in range(G):
        layer = g_layer[g]
        step = g_step[g]
        a, b = g_ptr[g], g_ptr[g + 1]
        now += g_dense[g]
        if layer_pinned[layer]:
            hits[g] = b - a
            if pf_ptr[g + 1] > pf_ptr[g]:  # (a call with ~40 array arguments is not free)
                t, xfer_free = _prefetch(g, step, now, t, xfer_free, pf_ptr, pf_key, resident,
                                         pool_of_layer, pool_cap, occ, policy, prev, nxt, head,
                                         tail, protected, res_list, pos, last_use, count, ring,
                                         ring_n, hot_pow, window, occ_ptr, occ_grp, optr, evict_sl,
                                         redundant_sl, used, pref, ready, pf_loads, xfer_time,
                                         num_experts, num_layers)
            for i in range(a, b):
                now += acc_comp[i]
            g_end[g] = now
            continue
        # -- lookup (ascending expert ids) ------------------------------------------------
        nm = 0
        for i in range(a, b):
            k = acc_key[i]
            t += 1
            if resident[k]:
                hits[g] += 1
                pool = pool_of_layer[k // num_experts]
                if policy == LRU:
                    _unlink(k, prev, nxt, head, tail, pool)
                    _push_head(k, prev, nxt, head, tail, pool)
                last_use[k] = t
                _touch(k, step, policy, count, ring, ring_n)
                if pref[k]:
                    pf_hits[g] += 1
                    pref[k] = False
                used[k] = True
            else:
                miss_buf[nm] = k
                miss_comp[nm] = acc_comp[i]
                is_miss[k] = True
                nm += 1
            protected[k] = True
        misses[g] = nm
        # -- demand transfers are queued FIFO at the end of the dense work ---------------
        for j in range(nm):
            k = miss_buf[j]
            start = max(xfer_free, now)
            xfer_free = start + xfer_time
            ready[k] = xfer_free
        # -- admissions: issue → done(hits) → issue → per admitted miss: done → issue ------
        na = 0
        nxt_miss = 0
        done_adm = 0
        hits_done = False
        pf_done = False
        while True:
            # issue()
            while nxt_miss < nm:
                k = miss_buf[nxt_miss]
                t2 = _admit(k, g, step, t, pool_of_layer, pool_cap, occ, policy, prev, nxt, head,
                            tail, protected, resident, res_list, pos, last_use, count, ring,
                            ring_n, hot_pow, window, occ_ptr, occ_grp, optr, evict_sl,
                            redundant_sl, used, pref, num_experts, num_layers)
                if t2 < 0:
                    break  # every slot holds an expert this layer still needs
                t = t2
                used[k] = True
                pref[k] = False
                adm_buf[na] = k
                na += 1
                nxt_miss += 1
            if not pf_done and nxt_miss >= nm:
                # every miss has a slot: prefetch for the layers ahead (as the live offloader)
                pf_done = True
                if pf_ptr[g + 1] > pf_ptr[g]:
                    t, xfer_free = _prefetch(g, step, now, t, xfer_free, pf_ptr, pf_key, resident,
                                             pool_of_layer, pool_cap, occ, policy, prev, nxt, head,
                                             tail, protected, res_list, pos, last_use, count, ring,
                                             ring_n, hot_pow, window, occ_ptr, occ_grp, optr,
                                             evict_sl, redundant_sl, used, pref, ready, pf_loads,
                                             xfer_time, num_experts, num_layers)
            if not hits_done:
                hits_done = True
                for i in range(a, b):
                    k = acc_key[i]
                    if not is_miss[k]:
                        protected[k] = False
                continue
            if done_adm < na:
                protected[adm_buf[done_adm]] = False
                done_adm += 1
                continue
            break
        for i in range(a, b):
            protected[acc_key[i]] = False
        # -- compute: resident experts first, then the misses, each after its transfer ---
        for i in range(a, b):
            k = acc_key[i]
            if not is_miss[k]:
                if ready[k] > now:  # a prefetch still in flight
                    stall[g] += ready[k] - now
                    now = ready[k]
                now += acc_comp[i]
        for j in range(nm):
            k = miss_buf[j]
            if ready[k] > now:
                stall[g] += ready[k] - now
                now = ready[k]
            now += miss_comp[j]
        for j in range(nm):
            is_miss[miss_buf[j]] = False
        g_end[g] = now
    unused_end = 0
    for k in range(num_keys):
        if resident[k] and not used[k]:
            unused_end += 1
    return unused_end


@njit(cache=True, _nrt=False, error_model="numpy")
def _admit(k, g, step, t, pool_of_layer, pool_cap, occ, policy, prev, nxt, head, tail, protected,
           resident, res_list, pos, last_use, count, ring, ring_n, hot_pow, window, occ_ptr,
           occ_grp, optr, evict_sl, redundant_sl, used, pref, num_experts, num_layers):
    """``ExpertCache.admit``: give ``k`` a slot, evicting the policy's victim among the
    unprotected residents of its pool if the pool is full (booked on the victim's layer, and as
    redundant if it was never used). Returns the new access clock, or -1 when every resident
    is protected (nothing changed)."""
    pool = pool_of_layer[k // num_experts]
    if occ[pool] >= pool_cap[pool]:
        victim = _victim(pool, policy, prev, tail, protected, res_list, occ, last_use, count,
                         ring, ring_n, hot_pow, window, step, g, occ_ptr, occ_grp, optr)
        if victim == -1:
            return -1
        _evict(victim, pool, policy, prev, nxt, head, tail, resident, res_list, occ, pos)
        vl = victim // num_experts
        evict_sl[step * num_layers + vl] += 1
        if not used[victim]:
            redundant_sl[step * num_layers + vl] += 1
        pref[victim] = False
    _insert(k, pool, policy, prev, nxt, head, tail, resident, res_list, occ, pos)
    t += 1
    last_use[k] = t
    _touch(k, step, policy, count, ring, ring_n)
    return t


@njit(cache=True, _nrt=False, error_model="numpy")
def _prefetch(g, step, now, t, xfer_free, pf_ptr, pf_key, resident, pool_of_layer, pool_cap, occ,
              policy, prev, nxt, head, tail, protected, res_list, pos, last_use, count, ring,
              ring_n, hot_pow, window, occ_ptr, occ_grp, optr, evict_sl, redundant_sl, used, pref,
              ready, pf_loads, xfer_time, num_experts, num_layers):
    """Admit group ``g``'s prefetch candidates in order (skipping resident ones and those no
    unprotected slot can take), queue their transfers behind the demand misses at ``now``.
    Returns the new (access clock, transfer-lane free time)."""
    for j in range(pf_ptr[g], pf_ptr[g + 1]):
        k = pf_key[j]
        if resident[k]:
            continue
        t2 = _admit(k, g, step, t, pool_of_layer, pool_cap, occ, policy, prev, nxt, head, tail,
                    protected, resident, res_list, pos, last_use, count, ring, ring_n, hot_pow,
                    window, occ_ptr, occ_grp, optr, evict_sl, redundant_sl, used, pref,
                    num_experts, num_layers)
        if t2 < 0:
            continue
        t = t2
        used[k] = False
        pref[k] = True
        xfer_free = max(xfer_free, now) + xfer_time
        ready[k] = xfer_free
        pf_loads[g] += 1
    return t, xfer_free


@njit(cache=True, _nrt=False, error_model="numpy")
def _insert(k, pool, policy, prev, nxt, head, tail, resident, res_list, occ, pos):
    resident[k] = True
    if policy == LRU:  # the list is LRU's whole state; the others scan res_list
        _push_head(k, prev, nxt, head, tail, pool)
    else:
        res_list[pool, occ[pool]] = k
        pos[k] = occ[pool]
    occ[pool] += 1


@njit(cache=True, _nrt=False, error_model="numpy")
def _evict(k, pool, policy, prev, nxt, head, tail, resident, res_list, occ, pos):
    resident[k] = False
    if policy == LRU:
        _unlink(k, prev, nxt, head, tail, pool)
    else:
        last = res_list[pool, occ[pool] - 1]
        res_list[pool, pos[k]] = last
        pos[last] = pos[k]
        res_list[pool, occ[pool] - 1] = -1
        pos[k] = -1
    occ[pool] -= 1


@njit(cache=True, _nrt=False, error_model="numpy")
def _victim(pool, policy, prev, tail, protected, res_list, occ, last_use, count, ring, ring_n,
            hot_pow, window, step, g, occ_ptr, occ_grp, optr):
    """The key to evict from ``pool`` (-1: every resident is protected). Mirrors the
    ``choose_victim`` of the policy classes in workbench/policies/eviction.py, ties included."""
    if policy == LRU:
        x = tail[pool]
        while x != -1 and protected[x]:
            x = prev[x]
        return x
    best = -1
    b1 = 0.0
    b2 = 0
    for j in range(occ[pool]):
        k = res_list[pool, j]
        if protected[k]:
            continue
        if policy == LFU:
            s1 = float(count[k])
        elif policy == HOTNESS:
            s1 = _hot_score(k, step, ring, ring_n, hot_pow, window)
        else:  # BELADY: farthest next use first
            s1 = -float(_next_use(k, g, occ_ptr, occ_grp, optr))
        s2 = last_use[k]
        if best == -1 or s1 < b1 or (s1 == b1 and (s2 < b2 or (s2 == b2 and k < best))):
            best, b1, b2 = k, s1, s2
    return best
