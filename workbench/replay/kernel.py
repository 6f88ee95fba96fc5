"""The compiled replay loop (numba): cache, prefetch and modeled timeline over access groups.

It performs exactly the calls the live runtime makes on the expert cache (lookup → LayerFill
admissions → prefetch) and prices them the way the modeled clock does, for the built-in
eviction policies, with array state instead of Python objects. ``engine.replay(...,
engine="python")`` runs the same sequence through the real policy objects; tests hold the two
equal (``tests/test_replay.py`` on the real Mixtral trace, ``tests/test_replay_speed.py`` on
generated ones, ``tests/test_transfer_order.py`` under both transfer orders on both).

State per key (``layer · E + expert``), packed key-major so that one key's fields share a cache
line and the helpers take a handful of arrays (numba passes every array argument as a struct of
~7 words; with ~40 of them a helper call cost more than the work it did):

- ``ks`` int64 ``[key, 8]``: LRU (ARC, S3-FIFO) list links, slot in its pool's resident list
  (every policy but LRU), last use on the access clock ``t``, LFU use count (reuse-eta:
  the turn of its layer it last ran at), hotness ring fill, Belady's pointer into the key's
  future groups and its next-use group (least-stale, reuse-eta: the key's layer);
- ``kf`` uint8 ``[key, 8]``: resident / protected / missed-this-group / used-since-load /
  prefetched-unused flags, the ARC / S3-FIFO list the key is in, pending on the transfer lane;
- ``lq`` int64 ``[key + 1, 2]``, ``lat`` float64 ``[key]``: demand-first's pending prefetches
  on the transfer lane, in issue order, and when each was issued (see "the transfer lane");
- ``ready`` float64 ``[key]``: modeled time its transfer completes; ``ring`` the hotness ring
  (``hot_pow`` its γ^age table; reuse-eta's W(age) table instead);
- ``aux`` int64: the layer being served and, for reuse-eta, each layer's turns and each pool's
  age counts (see ``AUX_*``).

**least-stale** and **reuse-eta** scan the pool as LFU does, with the scores of their policy
classes (same float operations, so ties break alike). **ARC** keeps its four lists (T1, T2 and
the ghosts B1, B2) as linked lists over the keys (``ks`` PREV/NEXT, ``kf`` LIST), their ends
and lengths per pool in ``aux``, its target p per pool in ``hot_pow``; **S3-FIFO** its small,
main and ghost FIFOs the same way (counts in ``ks`` COUNT). Both have flat kernels too
(:func:`flat_arc_hits`, :func:`flat_s3fifo_hits`).

**Belady** evicts the unprotected resident with the farthest next use, then the oldest last
use, then the smallest key. Residents keep a fixed slot in their pool (``res``; a victim's slot
goes to the key that replaces it, a cancelled prefetch's to the pool's last resident), each
key its next-use group ``ks[k, NU]``. A resident's next
use only changes when it is used, and every use of an offloaded key is a lookup of this loop,
so the order is known without searching the future at every eviction; each pool keeps a
*winner tree* over its slots (``tree``, see "Belady's winner tree" below) whose root is the
victim: O(log slots) per change and per eviction, no branch on the data, where the scan over
the pool cost O(slots) next-use searches per eviction.

Speeds, measured: BENCHMARKS.md, "Replay speed on any trace (issue 11)".

The flat one-key-per-access kernels at the end (:func:`flat_lru_hits`, :func:`flat_belady_hits`)
serve :func:`workbench.replay.flat.flat_hits`; :func:`occurrences` builds Belady's future in
O(accesses).
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

LRU, LFU, BELADY, HOTNESS, LSTALE, RETA, ARC, S3FIFO = 0, 1, 2, 3, 4, 5, 6, 7
POLICY_CODES = {"lru": LRU, "lfu": LFU, "belady": BELADY, "hotness": HOTNESS,
                "least-stale": LSTALE, "reuse-eta": RETA, "arc": ARC, "s3fifo": S3FIFO}
AGE_CAP = 16  # reuse-eta's ages pooled at and beyond (ReuseETA.AGE_CAP; tested equal)
# aux (int64, one per replay): [0] the layer being served, [1] layers L, [2] experts E,
# [3 : 3 + L] turns served per layer (reuse-eta), then per pool reuse-eta's ran[AGE_CAP + 1]
# and seen[AGE_CAP + 1] (ages 0 … AGE_CAP)
AUX_LAYER, AUX_L, AUX_E, AUX_TURNS = 0, 1, 2, 3
RING = 64  # most hotness window steps the kernel keeps per key
NEVER = 1 << 62  # next use of a key with no future access (farther than any group index)
PACK_NEVER = (1 << 31) - 1  # NEVER in a packed priority (finite next uses stay below it)
#: Belady keeps its winner tree over fewer groups than this (its packed priorities hold next
#: uses below PACK_NEVER), else it scans its pool. Read in Python only, never by a kernel: tests
#: lower it to run Belady without its tree. (They lowered PACK_NEVER once, which also made
#: ``occ_dtype`` int64 and cost a second cold compile of ``_simulate``; and a global a kernel
#: reads is frozen into its cached machine code at whatever value it has then.)
TREE_MAX_GROUPS = PACK_NEVER

# ks columns
PREV, NEXT, POS, LAST, COUNT, RING_N, OPTR, NU = 0, 1, 2, 3, 4, 5, 6, 7
# kf columns (LIST: ARC's list of the key, 0 none, T1, T2, B1, B2; PEND: a pending prefetch on
# the transfer lane, in its list ``lq``: the flag sits in the row the hot loops read anyway)
RES, PROT, MISS, USED, PREF, LIST, PEND = 0, 1, 2, 3, 4, 5, 6
T1, T2, B1, B2 = 1, 2, 3, 4
# ARC's per-pool state in aux, from _arc(pool): MRU ends of T1 … B2 (+0 … +3), LRU ends
# (+4 … +7), lengths (+8 … +11), the incoming key's ghost list (+12: 0, 1 for B1, 2 for B2) and
# the victim that leaves without a ghost entry (+13); its target p per pool in hot_pow
ARC_W = 14
# S3-FIFO's, the same list layout (lists SMALL, MAIN, GHOST = 1, 2, 3; counts in ks COUNT):
# +12 the incoming key was in the ghost, +13 anything evicted yet, +14 the victim enters the ghost
SMALL, MAIN, GHOST = 1, 2, 3
S3_W = 16
# pl (per pool) columns: LRU list ends, residents, slots
HEAD, TAIL, OCC, CAP = 0, 1, 2, 3
# go (per group, int) rows
G_HITS, G_MISSES, G_PF_LOADS, G_PF_HITS = 0, 1, 2, 3

# numba's reference counting costs atomic increments on every array passed to a helper (~85 %
# of the loop when it was on): the callers allocate everything, nothing here allocates
_JIT = dict(cache=True, _nrt=False, error_model="numpy", boundscheck=False)
# Belady's per-access helpers are inlined by numba itself: LLVM left them as calls, and inlining
# measured ~30 % faster on Belady (the LRU helpers, which LLVM inlines already, were not faster)
_HOT = dict(inline="always", **_JIT)


@njit(**_JIT)
def _unlink(k, ks, pl, pool):
    p, n = ks[k, PREV], ks[k, NEXT]
    if p != -1:
        ks[p, NEXT] = n
    else:
        pl[pool, HEAD] = n
    if n != -1:
        ks[n, PREV] = p
    else:
        pl[pool, TAIL] = p
    ks[k, PREV] = -1
    ks[k, NEXT] = -1


@njit(**_JIT)
def _push_head(k, ks, pl, pool):
    h = pl[pool, HEAD]
    ks[k, PREV] = -1
    ks[k, NEXT] = h
    if h != -1:
        ks[h, PREV] = k
    pl[pool, HEAD] = k
    if pl[pool, TAIL] == -1:
        pl[pool, TAIL] = k


@njit(**_JIT)
def _touch(k, step, policy, ks, ring):
    """A use of ``k`` in ``step`` (policy state the kernel keeps only for the policy in use)."""
    if policy == LFU:
        ks[k, COUNT] += 1
    elif policy == HOTNESS:
        n = ks[k, RING_N]
        if n == 0 or ring[k, (n - 1) % RING] != step:
            ring[k, n % RING] = step
            ks[k, RING_N] = n + 1


@njit(**_JIT)
def _hot_score(k, step, ks, ring, hot_pow, window):
    n = ks[k, RING_N]
    lo = n
    while lo > max(0, n - RING) and step - ring[k, (lo - 1) % RING] < window:
        lo -= 1  # uses are at distinct, increasing steps: stop at the first one too old
    s = 0.0
    for j in range(lo, n):  # oldest first, as the Python policy sums
        s += hot_pow[step - ring[k, j % RING]]
    return s


@njit(**_HOT)
def _next_use(k, g, ks, occ_ptr, occ_grp):
    """First group after ``g`` that uses ``k`` (:data:`NEVER`: none). ``g`` never decreases
    between calls for one key, so the pointer only moves forward: O(occurrences) in all."""
    i = ks[k, OPTR]
    end = occ_ptr[k + 1]
    while i < end and occ_grp[i] <= g:
        i += 1
    ks[k, OPTR] = i
    if i < end:
        return occ_grp[i]
    return NEVER


# -- Belady's winner tree ---------------------------------------------------------------------
# Each pool has an 8-ary tree over its slots (row ``tree[pool]``, laid out like a heap: node i's
# children are 8i+1 … 8i+8, the leaves from index (len - 1) / 8 on, one per slot): a leaf holds
# the eviction priority of the key in its slot (-1: empty), an inner node the largest below it,
# so the root holds the victim's. 8-ary: a change re-reads 8 siblings per level (independent
# loads, one cache line) over log8(slots) levels — 2 for 64 slots, 4 for 4096 — where a binary
# tree or heap walked twice as many dependent levels (measured ~2× slower).
#
# A priority packs Belady's order into one int64: (next use << 32) | (2^32 - 1 - last use) —
# farther next use first, then older last use. Last uses are distinct access-clock values, so
# no two keys tie (the policy's key-id tie-break is never reached). simulate() uses the tree
# only where both fit (next use < 2^31 - 1, clock < 2^32: about a billion accesses); beyond
# that Belady scans the pool, as LFU does.
#
# Pending keys: while a key of the current group g is protected (a hit until the hits are done,
# an admitted miss until it is done) its priority stays at next use ≤ g — a hit keeps its old
# one, whose next use is g; an admitted miss gets 0 — below every unprotected resident, whose
# next use is > g. Its real next use is set when it is unprotected (_bel_fix). So the root is
# the victim when its next use is > g, and otherwise every resident is protected (no victim).
@njit(**_HOT)
def _pack(nu, last):
    return (min(nu, PACK_NEVER) << 32) | (0xFFFFFFFF - last)


@njit(**_HOT)
def _tree_set(pool, slot, v, tree):
    """Set ``slot``'s priority to ``v`` and recompute the maxima above it. Written without
    data-dependent branches (all levels, maxima as selects): with them, mispredictions cost
    more than the work (measured)."""
    i = ((tree.shape[1] - 1) >> 3) + slot
    tree[pool, i] = v
    while i > 0:
        p = (i - 1) >> 3
        c = 8 * p + 1
        m = tree[pool, c]
        for j in range(c + 1, c + 8):
            x = tree[pool, j]
            m = x if x > m else m
        tree[pool, p] = m
        i = p


@njit(**_HOT)
def _tree_raise(pool, slot, v, tree):
    """Set ``slot``'s priority to ``v``, not below its old one (a fix: the common update): each
    maximum above it becomes max(itself, v) — every level, as a select, no data-dependent
    branch (stopping at the first maximum already ≥ v mispredicted more than it saved)."""
    i = ((tree.shape[1] - 1) >> 3) + slot
    tree[pool, i] = v
    while i > 0:
        i = (i - 1) >> 3
        x = tree[pool, i]
        tree[pool, i] = v if v > x else x


@njit(**_HOT)
def _tree_victim(pool, g, res, tree):
    """The key in the slot of the root's priority (-1: its next use is ≤ g, so every
    resident is a protected key of group g)."""
    v = tree[pool, 0]
    if (v >> 32) <= g:
        return -1
    leaves = (tree.shape[1] - 1) >> 3
    i = 0
    while i < leaves:  # down to the leaf holding v: exactly one child holds it (priorities
        c = 8 * i + 1  # > 0 are distinct), found without a branch per child
        j = 0
        for d in range(8):
            j += d * (tree[pool, c + d] == v)
        i = c + j
    return res[pool, i - leaves]


@njit(**_HOT)
def _bel_fix(k, g, pool, ks, tree, occ_ptr, occ_grp):
    """Key ``k`` of group ``g`` is unprotected (or used in a pinned group): it gets its real
    next use after ``g`` — a higher priority than its pending one (next use ≤ g)."""
    v = _next_use(k, g, ks, occ_ptr, occ_grp)
    ks[k, NU] = v
    if tree.shape[1] > 1:
        _tree_raise(pool, ks[k, POS], _pack(v, ks[k, LAST]), tree)


# -- the transfer lane (workbench.sim.lane.TransferLane) -------------------------------------
# ``lanes[1]`` is TransferLane.free: when the copies started so far are all done (modeled
# seconds). A copy starts at max(free, its issue time) and lands ``xfer_time`` later, in
# ``ready[key]``. FIFO starts every copy when it is issued. Demand-first keeps its *pending*
# prefetches (issued, not started) in issue order in a circular doubly linked list over the
# keys: ``lq[k] = (prev, next)``, the sentinel row ``lq[num_keys]`` holding (newest, oldest);
# ``kf[k, PEND]`` says whether ``k`` is in it; ``lat[k]`` is when pending ``k`` was issued.
# Invariants: a pending key is resident (a cancelled one leaves the cache at once), so it is
# pending at most once (a second prefetch of a resident key is skipped); issue times grow
# along the list. The helpers are TransferLane's methods one by one (same float
# operations, same order); under FIFO the list stays empty and every one of them but
# :func:`_lane_prefetch` does nothing. One liberty: TransferLane.cancel advances the lane at
# every eviction while anything is pending, :func:`_evict` only when the victim is pending.
# The copies it leaves pending start at the same times later: the lane's times only grow from
# call to call (a group's issue time, then its end), and every later demand, land or
# cancellation starts the oldest pending copies first, before anything else moves ``free``.
FIFO, DEMAND_FIRST = 0, 1
ORDER_CODES = {"fifo": FIFO, "demand-first": DEMAND_FIRST}


@njit(**_HOT)
def _lane_start(k, at, xfer_time, ready, lanes):
    """TransferLane._start: ``k``'s copy starts at max(free, ``at``), lands one transfer later."""
    end = max(lanes[1], at) + xfer_time
    lanes[1] = end
    ready[k] = end


@njit(**_HOT)
def _lane_unlink(k, lq, kf):
    """Take pending ``k`` off the list (it starts, or is cancelled)."""
    p, n = lq[k, 0], lq[k, 1]
    lq[p, 1] = n
    lq[n, 0] = p
    kf[k, PEND] = 0


@njit(**_HOT)
def _lane_pop_start(xfer_time, lq, lat, kf, ready, lanes):
    """Start the oldest pending prefetch."""
    k = lq[lq.shape[0] - 1, 1]
    _lane_unlink(k, lq, kf)
    _lane_start(k, lat[k], xfer_time, ready, lanes)


@njit(**_HOT)
def _lane_advance(until, xfer_time, lq, lat, kf, ready, lanes):
    """TransferLane.advance: start, oldest first, the pending prefetches that begin before
    ``until`` (a demand issued at ``until`` goes before them and the rest); the first that
    begins at or after ``until`` stops it."""
    s = lq.shape[0] - 1
    while lq[s, 1] != s and max(lanes[1], lat[lq[s, 1]]) < until:
        _lane_pop_start(xfer_time, lq, lat, kf, ready, lanes)


@njit(**_HOT)
def _lane_demand(k, now, xfer_time, lq, lat, kf, ready, lanes):
    """TransferLane.demand: a demand load of ``k`` issued at ``now``, behind the copies started
    by then (FIFO: every copy is started when issued)."""
    _lane_advance(now, xfer_time, lq, lat, kf, ready, lanes)
    _lane_start(k, now, xfer_time, ready, lanes)


@njit(**_HOT)
def _lane_prefetch(k, now, order, xfer_time, lq, lat, kf, ready, lanes):
    """TransferLane.prefetch: FIFO starts ``k``'s copy now; demand-first queues it, pending."""
    if order == FIFO:
        _lane_start(k, now, xfer_time, ready, lanes)
        return
    s = lq.shape[0] - 1
    last = lq[s, 0]
    lq[k, 0] = last
    lq[k, 1] = s
    lq[last, 1] = k
    lq[s, 0] = k
    kf[k, PEND] = 1
    lat[k] = now


@njit(**_HOT)
def _lane_land(k, xfer_time, lq, lat, kf, ready, lanes):
    """TransferLane.land: when ``k``'s copy lands; pending ``k`` and every prefetch ahead of it
    start first (the compute lane waits for ``k``: no demand comes between). A copy computed
    before reads a time ≤ the compute lane's (TransferLane popped it: None), so no stall."""
    while kf[k, PEND]:
        _lane_pop_start(xfer_time, lq, lat, kf, ready, lanes)
    return ready[k]


# -- the cache -------------------------------------------------------------------------------
@njit(**_JIT)
def _res_remove(k, pool, ks, pl, res):
    """Take resident ``k`` out of its pool's list (LFU, hotness): the last entry fills its
    place."""
    n = pl[pool, OCC] - 1
    i = ks[k, POS]
    last = res[pool, n]
    res[pool, n] = -1
    ks[k, POS] = -1
    pl[pool, OCC] = n
    if i < n:
        res[pool, i] = last
        ks[last, POS] = i


@njit(**_HOT)
def _ahead(j, cur, L):
    """Groups until layer ``j`` is served again when ``cur`` is (1 … L; LeastStale.ahead):
    (j − cur − 1) mod L + 1 for layers 0 … L−1, without a division."""
    d = j - cur - 1
    if d < 0:
        d += L
    return d + 1


@njit(**_HOT)
def _hz(pool, aux):
    """Offset of ``pool``'s reuse-eta counts in ``aux``: ran at +a, seen at +AGE_CAP+1+a."""
    return AUX_TURNS + aux[AUX_L] + pool * 2 * (AGE_CAP + 1)


@njit(**_JIT)
def _reta_waits(pool, aux, w):
    """ReuseETA.waits into ``w[0 … AGE_CAP]`` (the same float operations, in the same order)."""
    o = _hz(pool, aux)
    r = 0
    n = 0
    for a in range(AGE_CAP + 1):
        r += aux[o + a]
        n += aux[o + AGE_CAP + 1 + a]
    h0 = (r + 1) / (n + 2)
    for a in range(AGE_CAP, -1, -1):
        h = min(max((aux[o + a] + h0) / (aux[o + AGE_CAP + 1 + a] + 1), 1e-6), 1.0)
        if a == AGE_CAP:
            w[a] = (1.0 - h) / h
        else:
            w[a] = (1.0 - h) * (1.0 + w[a + 1])


@njit(**_JIT)
def _reta_turn(layer, pool, ks, aux):
    """ReuseETA.begin_layer: every key of ``layer`` that ran before is seen at its age; the
    layer's turn count grows."""
    E = aux[AUX_E]
    n = aux[AUX_TURNS + layer]
    if pool >= 0:
        o = _hz(pool, aux) + AGE_CAP + 1
        for e in range(E):
            u = ks[layer * E + e, COUNT]
            if u >= 0:
                aux[o + min(n - u - 1, AGE_CAP)] += 1
    aux[AUX_TURNS + layer] = n + 1


@njit(**_JIT)
def _reta_use(k, pool, ks, aux):
    """ReuseETA.on_hit / on_insert of a key of the layer being served: it ran at this turn."""
    E = aux[AUX_E]
    j = k // E
    if j != aux[AUX_LAYER]:
        return
    n = aux[AUX_TURNS + j] - 1
    u = ks[k, COUNT]
    if u >= 0 and u < n:
        aux[_hz(pool, aux) + min(n - u - 1, AGE_CAP)] += 1
    ks[k, COUNT] = n


# -- ARC (workbench.policies.eviction.ARC, as libCacheSim's ARC.c) -------------------------------
@njit(**_HOT)
def _arc(pool, aux):
    return AUX_TURNS + aux[AUX_L] + pool * ARC_W


@njit(**_JIT)
def _arc_unlink(k, ks, kf, aux, o):
    lst = kf[k, LIST]
    p, n = ks[k, PREV], ks[k, NEXT]
    if p != -1:
        ks[p, NEXT] = n
    else:
        aux[o + lst - 1] = n
    if n != -1:
        ks[n, PREV] = p
    else:
        aux[o + 4 + lst - 1] = p
    ks[k, PREV] = -1
    ks[k, NEXT] = -1
    aux[o + 8 + lst - 1] -= 1
    kf[k, LIST] = 0


@njit(**_JIT)
def _arc_push(k, lst, ks, kf, aux, o):
    """``k`` at the MRU end of list ``lst``."""
    h = aux[o + lst - 1]
    ks[k, PREV] = -1
    ks[k, NEXT] = h
    if h != -1:
        ks[h, PREV] = k
    aux[o + lst - 1] = k
    if aux[o + 4 + lst - 1] == -1:
        aux[o + 4 + lst - 1] = k
    aux[o + 8 + lst - 1] += 1
    kf[k, LIST] = lst


@njit(**_JIT)
def _arc_oldest(lst, ks, kf, aux, o):
    """The least recently used unprotected key of list ``lst`` (-1: none)."""
    x = aux[o + 4 + lst - 1]
    while x != -1 and kf[x, PROT]:
        x = ks[x, PREV]
    return x


@njit(**_JIT)
def _arc_before(k, pool, ks, kf, pl, aux, pp):
    """ARC.before_admit: a key found in a ghost list adapts p and leaves the ghost."""
    o = _arc(pool, aux)
    aux[o + 12] = 0
    lst = kf[k, LIST]
    nb1, nb2 = aux[o + 8 + B1 - 1], aux[o + 8 + B2 - 1]
    if lst == B1:
        pp[pool] = min(pp[pool] + max(nb2 / nb1, 1.0), float(pl[pool, CAP]))
        _arc_unlink(k, ks, kf, aux, o)
        aux[o + 12] = 1
    elif lst == B2:
        pp[pool] = max(pp[pool] - max(nb1 / nb2, 1.0), 0.0)
        _arc_unlink(k, ks, kf, aux, o)
        aux[o + 12] = 2


@njit(**_JIT)
def _arc_replace(pool, in_b2, ks, kf, aux, pp, o):
    n1 = aux[o + 8 + T1 - 1]
    first, second = T1, T2
    if not ((n1 > 0 and (n1 > pp[pool] or (n1 == pp[pool] and in_b2)))
            or aux[o + 8 + T2 - 1] == 0):
        first, second = T2, T1
    x = _arc_oldest(first, ks, kf, aux, o)
    if x == -1:
        x = _arc_oldest(second, ks, kf, aux, o)
    return x


@njit(**_JIT)
def _arc_victim(k, pool, ks, kf, pl, aux, pp):
    """ARC.before_admit then ARC.choose_victim for ``k`` (-1, nothing changed: every resident
    is protected)."""
    o = _arc(pool, aux)
    if _arc_oldest(T1, ks, kf, aux, o) == -1 and _arc_oldest(T2, ks, kf, aux, o) == -1:
        return -1
    _arc_before(k, pool, ks, kf, pl, aux, pp)
    aux[o + 13] = -1
    ghost = aux[o + 12]
    if ghost != 0:  # cases II and III
        return _arc_replace(pool, ghost == 2, ks, kf, aux, pp, o)
    c = pl[pool, CAP]
    n1, n2 = aux[o + 8 + T1 - 1], aux[o + 8 + T2 - 1]
    nb1, nb2 = aux[o + 8 + B1 - 1], aux[o + 8 + B2 - 1]
    if n1 + nb1 + 1 > c:  # case IV A
        if nb1 > 0:
            _arc_unlink(aux[o + 4 + B1 - 1], ks, kf, aux, o)
            return _arc_replace(pool, False, ks, kf, aux, pp, o)
        x = _arc_oldest(T1, ks, kf, aux, o)
        if x != -1:
            aux[o + 13] = x
            return x
        return _arc_replace(pool, False, ks, kf, aux, pp, o)
    if n1 + nb1 + n2 + nb2 >= 2 * c and nb2 > 0:  # case IV B
        _arc_unlink(aux[o + 4 + B2 - 1], ks, kf, aux, o)
    return _arc_replace(pool, False, ks, kf, aux, pp, o)


@njit(**_JIT)
def _arc_gone(x, pool, ks, kf, aux):
    """ARC.on_evict: the victim's ghost entry (none for case IV A's T1 victim)."""
    o = _arc(pool, aux)
    lst = kf[x, LIST]
    ghost = x != aux[o + 13]
    aux[o + 13] = -1
    _arc_unlink(x, ks, kf, aux, o)
    if ghost:
        _arc_push(x, B1 if lst == T1 else B2, ks, kf, aux, o)


@njit(**_JIT)
def _arc_insert(k, pool, ks, kf, aux):
    o = _arc(pool, aux)
    _arc_push(k, T2 if aux[o + 12] != 0 else T1, ks, kf, aux, o)
    aux[o + 12] = 0


@njit(**_JIT)
def _arc_hit(k, pool, ks, kf, aux):
    o = _arc(pool, aux)
    _arc_unlink(k, ks, kf, aux, o)
    _arc_push(k, T2, ks, kf, aux, o)


# -- S3-FIFO (workbench.policies.eviction.S3FIFO, as libCacheSim's S3FIFO.c) -------------------
@njit(**_HOT)
def _s3(pool, aux):
    return AUX_TURNS + aux[AUX_L] + pool * S3_W


@njit(**_JIT)
def _s3_before(k, pool, ks, kf, aux):
    """S3FIFO.before_admit: a key found in the ghost leaves it (and will enter main)."""
    o = _s3(pool, aux)
    aux[o + 12] = 0
    if kf[k, LIST] == GHOST:
        _arc_unlink(k, ks, kf, aux, o)
        aux[o + 12] = 1


@njit(**_JIT)
def _s3_main(ks, kf, aux, o):
    """S3FIFO._evict_main: a CLOCK over main (-1: no unprotected key in it)."""
    while True:
        x = _arc_oldest(MAIN, ks, kf, aux, o)
        if x == -1:
            return -1
        f = ks[x, COUNT]
        if f < 1:
            return x
        _arc_unlink(x, ks, kf, aux, o)
        _arc_push(x, MAIN, ks, kf, aux, o)
        ks[x, COUNT] = min(f, 3) - 1


@njit(**_JIT)
def _s3_small(ks, kf, aux, o):
    """S3FIFO._evict_small: keys used twice move to main; the first other one is the victim,
    bound for the ghost (-1: no unprotected key in small)."""
    while True:
        x = _arc_oldest(SMALL, ks, kf, aux, o)
        if x == -1:
            return -1
        if ks[x, COUNT] < 2:  # S3FIFO.THRESHOLD
            aux[o + 14] = 1
            return x
        _arc_unlink(x, ks, kf, aux, o)
        _arc_push(x, MAIN, ks, kf, aux, o)
        ks[x, COUNT] = 0


@njit(**_JIT)
def _s3_victim(k, pool, ks, kf, pl, aux):
    """S3FIFO.before_admit then S3FIFO.choose_victim for ``k`` (-1, nothing changed: every
    resident is protected)."""
    o = _s3(pool, aux)
    if _arc_oldest(SMALL, ks, kf, aux, o) == -1 and _arc_oldest(MAIN, ks, kf, aux, o) == -1:
        return -1
    _s3_before(k, pool, ks, kf, aux)
    aux[o + 13] = 1
    aux[o + 14] = 0
    c = pl[pool, CAP]
    main = c - int(c * 0.10)
    if aux[o + 8 + MAIN - 1] > main or aux[o + 8 + SMALL - 1] == 0:
        x = _s3_main(ks, kf, aux, o)
        if x == -1:
            x = _s3_small(ks, kf, aux, o)
    else:
        x = _s3_small(ks, kf, aux, o)
        if x == -1:
            x = _s3_main(ks, kf, aux, o)
    return x


@njit(**_JIT)
def _s3_gone(x, pool, ks, kf, pl, aux):
    """The victim leaves its queue; from small it enters the ghost (its oldest key dropped when
    the ghost holds ⌊0.9·c⌋)."""
    o = _s3(pool, aux)
    _arc_unlink(x, ks, kf, aux, o)
    if aux[o + 14]:
        aux[o + 14] = 0
        gcap = int(pl[pool, CAP] * 0.90)
        if gcap > 0:
            if aux[o + 8 + GHOST - 1] >= gcap:
                _arc_unlink(aux[o + 4 + GHOST - 1], ks, kf, aux, o)
            _arc_push(x, GHOST, ks, kf, aux, o)


@njit(**_JIT)
def _s3_insert(k, pool, ks, kf, pl, aux):
    o = _s3(pool, aux)
    c = pl[pool, CAP]
    if aux[o + 12] or (aux[o + 13] == 0 and aux[o + 8 + SMALL - 1] >= int(c * 0.10)):
        _arc_push(k, MAIN, ks, kf, aux, o)
    else:
        _arc_push(k, SMALL, ks, kf, aux, o)
    ks[k, COUNT] = 0
    aux[o + 12] = 0


@njit(**_JIT)
def _victim(pool, g, policy, ks, kf, pl, res, tree, ring, hot_pow, window, step, aux):
    """The key to evict from ``pool`` (-1: every resident is protected). Mirrors the
    ``choose_victim`` of the policy classes in workbench/policies/eviction.py, ties included."""
    if policy == LRU:
        x = pl[pool, TAIL]
        while x != -1 and kf[x, PROT]:
            x = ks[x, PREV]
        return x
    if policy == BELADY and tree.shape[1] > 1:
        return _tree_victim(pool, g, res, tree)
    best = -1
    b1 = 0.0
    b2 = 0
    L = aux[AUX_L]
    cur = aux[AUX_LAYER]
    if policy == RETA:  # its W table, in hot_pow (which only hotness reads)
        _reta_waits(pool, aux, hot_pow)
    for j in range(pl[pool, OCC]):
        k = res[pool, j]
        if kf[k, PROT]:
            continue
        if policy == LFU:
            s1 = float(ks[k, COUNT])
        elif policy == HOTNESS:
            s1 = _hot_score(k, step, ks, ring, hot_pow, window)
        elif policy == LSTALE:  # the farthest next turn of the key's layer first
            s1 = -float(_ahead(ks[k, NU], cur, L))  # (NU: the key's layer)
        elif policy == RETA:  # the longest expected wait first: ReuseETA.wait
            j = ks[k, NU]
            u = ks[k, COUNT]  # the turn of its layer it last ran at (-1: never)
            age = AGE_CAP if u < 0 else min(max(aux[AUX_TURNS + j] - u - 1, 0), AGE_CAP)
            s1 = -(float(_ahead(j, cur, L)) + float(L) * hot_pow[age])
        else:  # BELADY without its tree: farthest next use first (exact as a float: < 2^53)
            s1 = -float(ks[k, NU])
        s2 = ks[k, LAST]
        if best == -1 or s1 < b1 or (s1 == b1 and (s2 < b2 or (s2 == b2 and k < best))):
            best, b1, b2 = k, s1, s2
    return best


@njit(**_HOT)
def _evict(x, row, pool, policy, num_experts, num_layers, ks, kf, pl, res, sl, now, xfer_time,
           lq, lat, ready, lanes):
    """Take victim ``x`` out of ``pool`` at ``now``: booked on its layer of ``sl`` row ``row``
    (the step less the chunk's first step) in ``sl[0]``, and in ``sl[1]`` as redundant if never
    used — unless it is a pending prefetch that has not started by ``now`` (demand-first): that
    one is cancelled, in ``sl[2]`` (Simulator._unqueue: no copy is made, so none is wasted).
    Returns the slot it frees for Belady (-1 for the other policies, whose slot bookkeeping is
    the LRU list or the resident array)."""
    kf[x, RES] = 0
    c = row * num_layers + x // num_experts
    sl[0, c] += 1
    if kf[x, PEND]:  # pending: the copies that begin before now start first (cancel's advance)
        _lane_advance(now, xfer_time, lq, lat, kf, ready, lanes)
    if kf[x, PEND]:
        _lane_unlink(x, lq, kf)
        sl[2, c] += 1
    elif kf[x, USED] == 0:
        sl[1, c] += 1
    kf[x, PREF] = 0
    slot = -1
    if policy == LRU:
        _unlink(x, ks, pl, pool)
        pl[pool, OCC] -= 1
    elif policy == BELADY:
        slot = ks[x, POS]
        ks[x, POS] = -1
    else:
        _res_remove(x, pool, ks, pl, res)
    return slot


@njit(**_JIT)
def _drop(k, pool, policy, ks, kf, pl, res, tree, aux):
    """ExpertCache.cancel: ``k`` (a prefetch cancelled before its copy started) leaves ``pool``
    with no victim choice: its slot is freed and the policy told as for an eviction (ARC: into
    its list's ghost; S3-FIFO: no ghost), nothing counted here."""
    kf[k, RES] = 0
    kf[k, PREF] = 0
    if policy == LRU:
        _unlink(k, ks, pl, pool)
        pl[pool, OCC] -= 1
        return
    hole = ks[k, POS]
    last = pl[pool, OCC] - 1
    _res_remove(k, pool, ks, pl, res)  # the last resident moves into k's slot
    if policy == BELADY and tree.shape[1] > 1:  # and its leaf with it: slots stay 0 … OCC-1
        leaves = (tree.shape[1] - 1) >> 3
        if hole < last:
            _tree_set(pool, hole, tree[pool, leaves + last], tree)
        _tree_set(pool, last, -1, tree)
    elif policy == ARC:
        _arc_gone(k, pool, ks, kf, aux)
    elif policy == S3FIFO:
        _s3_gone(k, pool, ks, kf, pl, aux)


@njit(**_JIT)
def _cancel_ran(layer, row, now, policy, pool_of_layer, num_experts, num_layers, ks, kf, pl,
                res, tree, aux, sl, xfer_time, lq, lat, ready, lanes):
    """TransferLane.cancel then Simulator._end, at the end (``now``) of a group of ``layer``:
    the pending prefetches that have not started by ``now`` and are for ``layer`` or an earlier
    one are cancelled, oldest first (the policy sees them leave in that order), each booked in
    ``sl[2]`` row ``row`` on its layer."""
    _lane_advance(now, xfer_time, lq, lat, kf, ready, lanes)
    s = lq.shape[0] - 1
    k = lq[s, 1]
    while k != s:
        nxt = lq[k, 1]
        j = k // num_experts
        if j <= layer:
            _lane_unlink(k, lq, kf)
            _drop(k, pool_of_layer[j], policy, ks, kf, pl, res, tree, aux)
            sl[2, row * num_layers + j] += 1
        k = nxt


# inlined into both admission paths (a demand miss in _simulate, a prefetch in _prefetch): a call
# passing its ~20 arrays cost 2-3x the admission itself (measured), and this is the hottest path
@njit(**_HOT)
def _admit(k, g, step, s0, t, policy, pool, pending, num_experts, num_layers, ks, kf, pl, res,
           tree, ring, hot_pow, window, occ_ptr, occ_grp, sl, aux, now, xfer_time, lq, lat,
           ready, lanes):
    """``ExpertCache.admit``: give ``k`` a slot in ``pool``, evicting the policy's victim
    among its unprotected residents if it is full (:func:`_evict` at ``now``: booked on the
    victim's layer in ``sl[0]``, and in ``sl[1]`` as redundant if it was never used, or in
    ``sl[2]`` if it was a pending prefetch, cancelled). Returns the new access clock, or -1
    when every resident is protected (nothing changed). ``g``, ``step``: global group and
    step; ``s0`` the first step of ``sl``'s rows. ``pending``: a demand miss, protected until
    its transfer is done (Belady: next use 0 until :func:`_bel_fix`); else a prefetch, not
    protected (Belady gives it its real next use at once)."""
    slot = -1  # Belady: the victim's slot, which k takes
    if policy == ARC:
        if pl[pool, OCC] >= pl[pool, CAP]:
            x = _arc_victim(k, pool, ks, kf, pl, aux, hot_pow)
            if x == -1:
                return -1
            slot = _evict(x, step - s0, pool, policy, num_experts, num_layers, ks, kf, pl, res,
                          sl, now, xfer_time, lq, lat, ready, lanes)
            _arc_gone(x, pool, ks, kf, aux)
        else:
            _arc_before(k, pool, ks, kf, pl, aux, hot_pow)
    elif policy == S3FIFO:
        if pl[pool, OCC] >= pl[pool, CAP]:
            x = _s3_victim(k, pool, ks, kf, pl, aux)
            if x == -1:
                return -1
            slot = _evict(x, step - s0, pool, policy, num_experts, num_layers, ks, kf, pl, res,
                          sl, now, xfer_time, lq, lat, ready, lanes)
            _s3_gone(x, pool, ks, kf, pl, aux)
        else:
            _s3_before(k, pool, ks, kf, aux)
    elif pl[pool, OCC] >= pl[pool, CAP]:
        # _victim's LRU and Belady-tree branches, written out: calling _victim for them (or
        # inlining all of it) measured slower on the demand path
        if policy == LRU:
            x = pl[pool, TAIL]
            while x != -1 and kf[x, PROT]:
                x = ks[x, PREV]
        elif policy == BELADY and tree.shape[1] > 1:
            x = _tree_victim(pool, g, res, tree)
        else:
            x = _victim(pool, g, policy, ks, kf, pl, res, tree, ring, hot_pow, window, step,
                        aux)
        if x == -1:
            return -1
        slot = _evict(x, step - s0, pool, policy, num_experts, num_layers, ks, kf, pl, res, sl,
                      now, xfer_time, lq, lat, ready, lanes)
    t += 1
    ks[k, LAST] = t
    kf[k, RES] = 1
    if policy == LRU:
        _push_head(k, ks, pl, pool)
        pl[pool, OCC] += 1
    else:
        if slot < 0:
            slot = pl[pool, OCC]
            pl[pool, OCC] = slot + 1
        res[pool, slot] = k
        ks[k, POS] = slot
        if policy == BELADY:
            if pending:  # protected until done: see _bel_fix
                ks[k, NU] = 0
                if tree.shape[1] > 1:
                    _tree_set(pool, slot, 0, tree)
            else:  # unprotected at once; the slot may have held a higher priority
                v = _next_use(k, g, ks, occ_ptr, occ_grp)
                ks[k, NU] = v
                if tree.shape[1] > 1:
                    _tree_set(pool, slot, _pack(v, t), tree)
        elif policy == RETA:
            _reta_use(k, pool, ks, aux)
        elif policy == ARC:
            _arc_insert(k, pool, ks, kf, aux)
        elif policy == S3FIFO:
            _s3_insert(k, pool, ks, kf, pl, aux)
        else:
            _touch(k, step, policy, ks, ring)
    return t


@njit(**_JIT)
def _prefetch(g, gg, step, s0, now, t, pf_ptr, pf_key, policy, pool_of_layer, num_experts,
              num_layers, ks, kf, pl, res, tree, ring, hot_pow, window, occ_ptr, occ_grp, sl,
              ready, go, xfer_time, aux, order, lq, lat, lanes):
    """Admit group ``g``'s prefetch candidates in order (skipping resident ones and those no
    unprotected slot can take), queue their transfers at ``now`` behind the demand misses
    (:func:`_lane_prefetch`, in ``order``). ``g`` indexes the chunk's arrays, ``gg`` is its
    global index (Belady's future). Returns the new access clock."""
    for j in range(pf_ptr[g], pf_ptr[g + 1]):
        k = pf_key[j]
        if kf[k, RES]:
            continue
        t2 = _admit(k, gg, step, s0, t, policy, pool_of_layer[k // num_experts], False,
                    num_experts, num_layers, ks, kf, pl, res, tree, ring, hot_pow, window,
                    occ_ptr, occ_grp, sl, aux, now, xfer_time, lq, lat, ready, lanes)
        if t2 < 0:
            continue
        t = t2
        kf[k, USED] = 0
        kf[k, PREF] = 1
        _lane_prefetch(k, now, order, xfer_time, lq, lat, kf, ready, lanes)
        go[G_PF_LOADS, g] += 1
    return t


class KernelState:
    """The replay's state between chunks of groups: per key (``ks``, ``kf``, ``ready``, the
    hotness ``ring``, the transfer lane's pending list ``lq`` and issue times ``lat``), per
    pool (``pl``, ``res``, Belady's ``tree``) and the clocks (access clock ``t``; modeled
    compute and transfer lanes). ``order``: the transfer lane's, :data:`FIFO` or
    :data:`DEMAND_FIRST` (:data:`ORDER_CODES`). A replay allocates it once and runs its
    groups through :meth:`run` in one call or in consecutive chunks — the same result, since
    every group only reads state the groups before it left (tested).

    ``clock_max``: an upper bound of the access clock (lookups + admissions + prefetch
    candidates) and ``num_groups`` of all groups, for the choice of Belady's tree; ``occ_ptr``:
    Belady's per-key CSR offsets (see :func:`simulate`), None for the other policies."""

    def __init__(self, num_keys: int, pool_cap: np.ndarray, policy: int, hot_pow: float,
                 window: int, num_experts: int, num_layers: int, num_groups: int,
                 clock_max: int, occ_ptr: np.ndarray | None = None, order: int = FIFO):
        P = pool_cap.shape[0]
        maxcap = max(1, int(pool_cap.max())) if P else 1
        self.policy, self.window, self.order = policy, int(window), int(order)
        self.num_experts, self.num_layers = int(num_experts), int(num_layers)
        self.ks = np.zeros((num_keys, 8), np.int64)
        ks = self.ks
        ks[:, PREV] = ks[:, NEXT] = ks[:, POS] = ks[:, LAST] = -1
        if occ_ptr is not None:
            ks[:, OPTR] = occ_ptr[:-1]
        if policy == RETA:
            ks[:, COUNT] = -1  # the turn each key last ran at: never
        if policy == LSTALE or policy == RETA:
            ks[:, NU] = np.arange(num_keys) // max(int(num_experts), 1)  # the key's layer
        self.kf = np.zeros((num_keys, 8), np.uint8)
        self.pl = np.zeros((P, 4), np.int64)
        self.pl[:, HEAD] = self.pl[:, TAIL] = -1
        self.pl[:, CAP] = pool_cap
        self.res = np.full((P, maxcap) if policy != LRU else (1, 1), -1, np.int64)
        # Belady's winner tree, where its packed priorities fit: next uses < 2^31 - 1, and the
        # access clock (one tick per lookup and per admission) < 2^32
        if policy == BELADY and num_groups < TREE_MAX_GROUPS and clock_max < (1 << 32) - 1:
            leaves, inner = 8, 1  # at least one level above the leaves (the root is inner)
            while leaves < maxcap:
                leaves, inner = leaves * 8, inner + leaves
            self.tree = np.full((P, inner + leaves), -1, np.int64)  # -1: empty, below every key
        else:
            self.tree = np.zeros((1, 1), np.int64)  # no tree (shape[1] == 1)
        self.ring = np.zeros((num_keys if policy == HOTNESS else 1, RING), np.int64)
        self.ready = np.zeros(num_keys, np.float64)
        # the lane's pending prefetches ("the transfer lane" above): none, the sentinel
        # linked to itself
        self.lq = np.full((num_keys + 1, 2), -1, np.int64)
        self.lq[num_keys] = num_keys
        self.lat = np.zeros(num_keys, np.float64)
        # the layer-order policies' state (see AUX_*): counts only for reuse-eta
        L = max(int(num_layers), 1)
        per_pool = {RETA: 2 * (AGE_CAP + 1), ARC: ARC_W, S3FIFO: S3_W}.get(policy)
        self.aux = np.zeros(AUX_TURNS + (L + P * per_pool if per_pool else 0), np.int64)
        self.aux[AUX_L], self.aux[AUX_E] = L, max(int(num_experts), 1)
        if policy == ARC or policy == S3FIFO:  # empty lists (ARC's p = 0: in hot_pow, below)
            for pool in range(P):
                o = AUX_TURNS + L + pool * per_pool
                self.aux[o:o + 8] = -1
        self.tick = np.zeros(1, np.int64)     # the access clock t
        self.lanes = np.zeros(2, np.float64)  # modeled compute lane, transfer lane free at
        # γ^age for age < window, computed by Python's float pow like the policy class does, so
        # that both sum identical terms in the same order (ties then break the same way)
        self.hot_pow = np.array([hot_pow ** a for a in range(max(int(window), 1))], np.float64)
        if policy == RETA:  # hot_pow is unused: reuse-eta's W table (written per eviction)
            self.hot_pow = np.zeros(AGE_CAP + 1, np.float64)
        if policy == ARC:  # hot_pow is unused: ARC's target p per pool
            self.hot_pow = np.zeros(max(P, 1), np.float64)
        n = max(1, num_experts)
        # a group holds distinct experts of one layer: at most num_experts misses
        self.bufs = (np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.float64))

    def run(self, g_layer, g_step, g_ptr, acc_key, g_dense, acc_comp, layer_pinned,
            pool_of_layer, occ_ptr, occ_grp, pf_ptr, pf_key, xfer_time, g0: int, s0: int,
            num_steps: int):
        """Run the groups of one chunk (arrays as in :func:`simulate`; ``g_step`` global steps,
        ``g0`` the global index of its first group, ``s0`` its first step, ``num_steps`` the
        steps it spans). Returns ``(go [4, G], gf [2, G], sl [3, num_steps × layers])``: per
        group hits, misses, prefetches, prefetch hits; stall and end time (modeled s); per
        (step, layer of the key) evictions, redundant prefetches, cancelled prefetches."""
        G = g_layer.shape[0]
        go = np.zeros((4, G), np.int64)
        gf = np.zeros((2, G), np.float64)  # stall, end time
        sl = np.zeros((3, num_steps * self.num_layers), np.int64)
        _simulate(g_layer, g_step, g_ptr, acc_key, g_dense, acc_comp, layer_pinned,
                  pool_of_layer, np.int64(self.policy), self.hot_pow, np.int64(self.window),
                  occ_ptr, occ_grp, pf_ptr, pf_key, np.float64(xfer_time),
                  np.int64(self.num_experts), np.int64(self.num_layers), self.ks, self.kf,
                  self.pl, self.res, self.tree, self.ring, self.ready, go, gf, sl, *self.bufs,
                  np.int64(g0), np.int64(s0), self.tick, self.lanes, self.aux,
                  np.int64(self.order), self.lq, self.lat)
        return go, gf, sl

    def unused_at_end(self) -> int:
        """Resident keys never used since they were loaded."""
        return int(_unused(self.kf))


@njit(**_JIT)
def _unused(kf):
    n = 0
    for k in range(kf.shape[0]):
        if kf[k, RES] and not kf[k, USED]:
            n += 1
    return n


def simulate(g_layer, g_step, g_ptr, acc_key, g_dense, acc_comp, layer_pinned, pool_of_layer,
             pool_cap, policy, hot_pow, window, occ_ptr, occ_grp, pf_ptr, pf_key, xfer_time,
             num_keys, num_experts, num_steps, num_layers):
    """Replay the groups (CSR ``g_ptr`` over ``acc_key``, keys ``layer · E + expert`` in serving
    order) through pools of ``pool_cap`` slots (``pool_of_layer``), pinned layers always hit;
    ``g_dense`` / ``acc_comp`` modeled seconds of dense work per group and expert work per
    access, ``xfer_time`` seconds per transfer; ``occ_ptr``/``occ_grp``: CSR of the groups each
    key occurs in, ascending (read by Belady only); ``pf_ptr``/``pf_key``: each group's prefetch
    candidates in order. Returns ``(hits, misses, pf_loads, pf_hits, stall_s, g_end_s)`` per
    group, ``(evictions, redundant)`` per ``step · num_layers + layer`` and the count of
    resident keys never used at the end: one :class:`KernelState` (the FIFO lane), one chunk."""
    G = g_layer.shape[0]
    state = KernelState(num_keys, pool_cap, policy, hot_pow, window, num_experts, num_layers, G,
                        2 * acc_key.shape[0] + pf_key.shape[0] + 1,
                        occ_ptr if policy == BELADY else None)
    go, gf, sl = state.run(g_layer, g_step, g_ptr, acc_key, g_dense, acc_comp, layer_pinned,
                           pool_of_layer, occ_ptr, occ_grp, pf_ptr, pf_key, xfer_time, 0, 0,
                           num_steps)
    return (go[G_HITS], go[G_MISSES], go[G_PF_LOADS], go[G_PF_HITS], gf[0], gf[1], sl[0], sl[1],
            state.unused_at_end())


@njit(**_JIT)
def _simulate(g_layer, g_step, g_ptr, acc_key, g_dense, acc_comp, layer_pinned, pool_of_layer,
              policy, hot_pow, window, occ_ptr, occ_grp, pf_ptr, pf_key, xfer_time, num_experts,
              num_layers, ks, kf, pl, res, tree, ring, ready, go, gf, sl, miss_buf, adm_buf,
              miss_comp, g0, s0, tick, lanes, aux, order, lq, lat):
    G = g_layer.shape[0]
    t = tick[0]  # the cache's access clock (ExpertCache.t)
    now = lanes[0]  # modeled compute lane (the transfer lane's free time stays in lanes[1]:
    # an eviction may start pending prefetches, see _evict)
    q = lq.shape[0] - 1  # the sentinel of demand-first's pending prefetches (q: none pending)

    for g in range(G):  # g indexes this chunk's arrays; gg is the group's global index
        gg = g0 + g
        layer = g_layer[g]
        step = g_step[g]
        a, b = g_ptr[g], g_ptr[g + 1]
        now += g_dense[g]
        aux[AUX_LAYER] = layer  # (the policies' begin_layer)
        if policy == RETA:
            _reta_turn(layer, -1 if layer_pinned[layer] else pool_of_layer[layer], ks, aux)
        if layer_pinned[layer]:
            go[G_HITS, g] = b - a
            if pf_ptr[g + 1] > pf_ptr[g]:
                t = _prefetch(g, gg, step, s0, now, t, pf_ptr, pf_key, policy, pool_of_layer,
                              num_experts, num_layers, ks, kf, pl, res, tree, ring, hot_pow,
                              window, occ_ptr, occ_grp, sl, ready, go, xfer_time, aux, order, lq,
                              lat, lanes)
            for i in range(a, b):
                now += acc_comp[i]
                if policy == BELADY and kf[acc_key[i], RES]:
                    # a pinned layer's key is never admitted (prefetch plans leave pinned layers
                    # out); should one be resident, its next use still moves on here
                    _bel_fix(acc_key[i], gg, pool_of_layer[layer], ks, tree, occ_ptr, occ_grp)
            if lq[q, 1] != q:  # the group's end (Simulator._end), as below
                _cancel_ran(layer, step - s0, now, policy, pool_of_layer, num_experts,
                            num_layers, ks, kf, pl, res, tree, aux, sl, xfer_time, lq, lat,
                            ready, lanes)
            gf[1, g] = now
            continue
        pool = pool_of_layer[layer]  # every key of the group is on this layer
        # -- lookup (ascending expert ids) ------------------------------------------------
        nm = 0
        nh = 0
        for i in range(a, b):
            k = acc_key[i]
            t += 1
            if kf[k, RES]:
                nh += 1
                if policy == LRU:
                    if pl[pool, HEAD] != k:
                        _unlink(k, ks, pl, pool)
                        _push_head(k, ks, pl, pool)
                ks[k, LAST] = t
                # (Belady: k keeps its priority, next use g, until it is unprotected)
                if policy == RETA:
                    _reta_use(k, pool, ks, aux)
                elif policy == ARC:
                    _arc_hit(k, pool, ks, kf, aux)
                elif policy == S3FIFO:
                    ks[k, COUNT] += 1
                else:
                    _touch(k, step, policy, ks, ring)
                if kf[k, PREF]:
                    go[G_PF_HITS, g] += 1
                    kf[k, PREF] = 0
                kf[k, USED] = 1
            else:
                miss_buf[nm] = k
                miss_comp[nm] = acc_comp[i]
                kf[k, MISS] = 1
                nm += 1
            kf[k, PROT] = 1
        go[G_HITS, g] = nh
        go[G_MISSES, g] = nm
        # -- demand transfers are issued at the end of the dense work, in order ----------
        for j in range(nm):
            _lane_demand(miss_buf[j], now, xfer_time, lq, lat, kf, ready, lanes)
        # -- admissions: issue → done(hits) → issue → per admitted miss: done → issue ------
        na = 0
        nxt_miss = 0
        done_adm = 0
        hits_done = False
        pf_done = False
        while True:
            # issue(): _admit each miss (inlined)
            while nxt_miss < nm:
                k = miss_buf[nxt_miss]
                t2 = _admit(k, gg, step, s0, t, policy, pool, True, num_experts, num_layers, ks,
                            kf, pl, res, tree, ring, hot_pow, window, occ_ptr, occ_grp, sl,
                            aux, now, xfer_time, lq, lat, ready, lanes)
                if t2 < 0:
                    break  # every slot holds an expert this layer still needs
                t = t2
                kf[k, USED] = 1
                kf[k, PREF] = 0
                adm_buf[na] = k
                na += 1
                nxt_miss += 1
            if not pf_done and nxt_miss >= nm:
                # every miss has a slot: prefetch for the layers ahead (as the live offloader)
                pf_done = True
                if pf_ptr[g + 1] > pf_ptr[g]:
                    t = _prefetch(g, gg, step, s0, now, t, pf_ptr, pf_key, policy,
                                  pool_of_layer, num_experts, num_layers, ks, kf, pl, res, tree,
                                  ring, hot_pow, window, occ_ptr, occ_grp, sl, ready, go,
                                  xfer_time, aux, order, lq, lat, lanes)
            if not hits_done:
                hits_done = True
                if nh:
                    for i in range(a, b):
                        k = acc_key[i]
                        if kf[k, MISS] == 0:
                            kf[k, PROT] = 0
                            if policy == BELADY:
                                _bel_fix(k, gg, pool, ks, tree, occ_ptr, occ_grp)
                continue
            if done_adm < na:
                k = adm_buf[done_adm]
                kf[k, PROT] = 0
                if policy == BELADY:
                    _bel_fix(k, gg, pool, ks, tree, occ_ptr, occ_grp)
                done_adm += 1
                continue
            break
        # -- compute: resident experts first, then the misses, each after its transfer ---
        stall = 0.0
        for i in range(a, b):
            k = acc_key[i]
            kf[k, PROT] = 0
            if kf[k, MISS] == 0:
                r = _lane_land(k, xfer_time, lq, lat, kf, ready, lanes)
                if r > now:  # a prefetch still in flight (or still pending: started now)
                    stall += r - now
                    now = r
                now += acc_comp[i]
        for j in range(nm):
            k = miss_buf[j]
            kf[k, MISS] = 0
            r = ready[k]  # (a demand load: started when issued, never pending)
            if r > now:
                stall += r - now
                now = r
            now += miss_comp[j]
        if lq[q, 1] != q:  # the group's end: cancel what its layer no longer needs
            _cancel_ran(layer, step - s0, now, policy, pool_of_layer, num_experts, num_layers,
                        ks, kf, pl, res, tree, aux, sl, xfer_time, lq, lat, ready, lanes)
        gf[0, g] = stall
        gf[1, g] = now
    tick[0] = t
    lanes[0] = now


# -- Belady's future, built in O(accesses) ----------------------------------------------------
@njit(cache=True, error_model="numpy", boundscheck=False)
def _occurrences(g_ptr, acc_key, num_keys, ptr, grp):
    for i in range(acc_key.shape[0]):
        ptr[acc_key[i] + 1] += 1
    for k in range(num_keys):
        ptr[k + 1] += ptr[k]
    fill = ptr[:-1].copy()
    for g in range(g_ptr.shape[0] - 1):  # groups in order: each key's list comes out ascending
        for i in range(g_ptr[g], g_ptr[g + 1]):
            k = acc_key[i]
            grp[fill[k]] = g
            fill[k] += 1


def occ_dtype(num_groups: int):
    """The dtype of Belady's future ``occ_grp`` over ``num_groups`` groups: int32 where every
    group index fits (4 bytes per access), else int64. Every caller of :func:`simulate` /
    :meth:`KernelState.run` passes this dtype, and :func:`no_future` when Belady does not
    run: numba compiles ``_simulate`` once per argument dtype, and each compilation of the
    inlined loop costs tens of seconds on a cold cache."""
    return np.int32 if num_groups < PACK_NEVER else np.int64


def no_future() -> np.ndarray:
    """The placeholder ``occ_grp`` of a replay without Belady (never read): the dtype
    :func:`occ_dtype` gives on any trace that fits, so that Belady and the other policies
    share one compiled ``_simulate``."""
    return np.zeros(1, np.int32)


def occurrences(g_ptr: np.ndarray, acc_key: np.ndarray, num_keys: int):
    """CSR ``(occ_ptr [num_keys+1], occ_grp [accesses])`` of the groups each key occurs in,
    ascending — what :func:`simulate` reads for Belady — by one counting pass (O(accesses +
    keys), no sort). Equal to a stable argsort of ``acc_key`` mapped to group indices;
    ``occ_grp`` of :func:`occ_dtype`."""
    ptr = np.zeros(num_keys + 1, np.int64)
    grp = np.zeros(acc_key.shape[0], occ_dtype(len(g_ptr) - 1))
    _occurrences(np.asarray(g_ptr, np.int64), np.asarray(acc_key, np.int64), num_keys, ptr, grp)
    return ptr, grp


@njit(cache=True, error_model="numpy", boundscheck=False)
def _fill_occ(g_ptr, acc_key, g0, fill, grp):
    for g in range(g_ptr.shape[0] - 1):
        for i in range(g_ptr[g], g_ptr[g + 1]):
            k = acc_key[i]
            grp[fill[k]] = g0 + g
            fill[k] += 1


def fill_occurrences(g_ptr: np.ndarray, acc_key: np.ndarray, g0: int, fill: np.ndarray,
                     grp: np.ndarray) -> None:
    """One chunk of :func:`occurrences` built chunk by chunk: the chunk's groups (global
    indices from ``g0``) appended to each key's list at ``fill[key]`` (advanced). Chunks in
    order give each key's list ascending."""
    _fill_occ(np.asarray(g_ptr, np.int64), np.asarray(acc_key, np.int64), np.int64(g0), fill,
              grp)


# -- flat traces: one key per access, nothing pinned (the libCacheSim / textbook view) ---------
@njit(cache=True, error_model="numpy", boundscheck=False)
def _dense_span(keys, lo, span):
    """Keys → 0..n-1 in order of first appearance, through a direct table of ``span`` entries
    (keys dense enough: ``key - lo`` indexes it)."""
    table = np.full(span, -1, np.int64)
    out = np.empty(keys.shape[0], np.int64)
    n = 0
    for i in range(keys.shape[0]):
        j = keys[i] - lo
        d = table[j]
        if d < 0:
            d = n
            table[j] = n
            n += 1
        out[i] = d
    return out, n


@njit(cache=True, error_model="numpy", boundscheck=False)
def _slot(key, bits):
    """Fibonacci hashing: the top ``bits`` bits of key · 2^64/φ (wrapping uint64 product)."""
    h = np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)
    return np.int64(h >> np.uint64(64 - bits))


@njit(cache=True, error_model="numpy", boundscheck=False)
def _dense_hash(keys):
    """Keys → 0..n-1 in order of first appearance, through an open-addressing hash table that
    doubles at half load (amortised O(1) per key, for keys too sparse for a direct table)."""
    bits = 12
    tk = np.zeros(1 << bits, np.int64)
    tv = np.full(1 << bits, -1, np.int64)
    out = np.empty(keys.shape[0], np.int64)
    n = 0
    for i in range(keys.shape[0]):
        key = keys[i]
        mask = (1 << bits) - 1
        j = _slot(key, bits)
        while tv[j] >= 0 and tk[j] != key:
            j = (j + 1) & mask
        if tv[j] >= 0:
            out[i] = tv[j]
            continue
        tk[j] = key
        tv[j] = n
        out[i] = n
        n += 1
        if 2 * n > (1 << bits):  # grow, re-inserting every key
            bits += 1
            mask = (1 << bits) - 1
            nk = np.zeros(1 << bits, np.int64)
            nv = np.full(1 << bits, -1, np.int64)
            for s in range(tk.shape[0]):
                if tv[s] >= 0:
                    j2 = _slot(tk[s], bits)
                    while nv[j2] >= 0:
                        j2 = (j2 + 1) & mask
                    nk[j2] = tk[s]
                    nv[j2] = tv[s]
            tk, tv = nk, nv
    return out, n


@njit(cache=True, error_model="numpy", boundscheck=False)
def _min_max(keys):
    """The least and the greatest of non-empty ``keys`` in one pass (numpy's min and max are
    two)."""
    lo = keys[0]
    hi = keys[0]
    for i in range(1, keys.shape[0]):  # branch-free: the loop vectorises
        k = keys[i]
        lo = min(lo, k)
        hi = max(hi, k)
    return lo, hi


def key_bounds(keys: np.ndarray) -> tuple[int, int]:
    """The least and the greatest of non-empty integer ``keys`` as Python ints, one pass
    (:func:`flat_hits <workbench.replay.flat.flat_hits>` reads them once for its three
    uses: on 10⁷ keys a pass costs ≈ 15 % of LRU's whole replay)."""
    lo, hi = _min_max(keys)
    return int(lo), int(hi)


def dense_keys(keys: np.ndarray, bounds: tuple[int, int] | None = None
               ) -> tuple[np.ndarray, int]:
    """``(ids, n)``: ``keys`` (int64, any values) relabelled 0..n-1 in order of first
    appearance, n distinct keys; O(len(keys)) (a direct table when the key range is at most
    ~2× the trace length, else a hash table). ``bounds``: the keys' least and greatest
    (:func:`key_bounds`), when known."""
    keys = np.ascontiguousarray(keys, np.int64)
    if not keys.size:
        return np.zeros(0, np.int64), 0
    lo, hi = bounds if bounds is not None else key_bounds(keys)
    span = hi - lo + 1  # Python ints: no overflow for any int64 range
    if span <= 2 * keys.size + (1 << 16):
        return _dense_span(keys, np.int64(lo), span)
    return _dense_hash(keys)


@njit(cache=True, error_model="numpy", boundscheck=False)
def _distinct_span(keys, lo, span, limit):
    """Distinct keys of ``keys`` (``key - lo`` indexes a table of ``span``), or -1 as soon as
    there are more than ``limit``."""
    seen = np.zeros(span, np.bool_)
    n = 0
    for i in range(keys.shape[0]):
        j = keys[i] - lo
        if not seen[j]:
            seen[j] = True
            n += 1
            if n > limit:
                return -1
    return n


def integer_keys(keys: np.ndarray) -> np.ndarray:
    """``keys`` as a contiguous integer array, read as it is when it is one already (any width
    up to int64: no int64 copy of a 10⁹-access uint16 trace); anything else (floats, bools,
    uint64, whose values int64 arithmetic could wrap) as an int64 copy."""
    keys = np.ascontiguousarray(keys)
    if keys.dtype.kind not in "iu" or keys.dtype == np.uint64:
        keys = np.ascontiguousarray(keys, np.int64)
    return keys


def distinct_at_most(keys: np.ndarray, limit: int,
                     bounds: tuple[int, int] | None = None) -> int | None:
    """How many distinct keys ``keys`` holds, when at most ``limit``; else None. Stops at the
    first key past ``limit`` (a cache smaller than the key space learns it within its first
    misses); O(len(keys)) with a direct table (keys dense enough, as :func:`dense_keys`), else
    through :func:`dense_keys`'s hash table. Integer keys of any width are read as they are
    (:func:`integer_keys`). ``bounds``: their least and greatest (:func:`key_bounds`), when
    known."""
    keys = integer_keys(keys)
    if not keys.size:
        return 0
    lo, hi = bounds if bounds is not None else key_bounds(keys)
    span = hi - lo + 1
    if span <= 2 * keys.size + (1 << 16):
        n = int(_distinct_span(keys, np.int64(lo), span, int(limit)))
        return None if n < 0 else n
    n = int(_dense_hash(np.ascontiguousarray(keys, np.int64))[1])
    return n if n <= limit else None


@njit(cache=True, error_model="numpy", boundscheck=False)
def _flat_lru(ids, lo, n_keys, cap):
    """LRU's hits over ``ids`` (key ``ids[i] - lo`` of ``n_keys``): a doubly linked list over
    the key ids."""
    prev = np.full(n_keys, -1, np.int64)
    nxt = np.full(n_keys, -1, np.int64)
    res = np.zeros(n_keys, np.bool_)
    head = -1
    tail = -1
    occ = 0
    hits = 0
    for i in range(ids.shape[0]):
        k = ids[i] - lo
        if res[k]:
            hits += 1
            if k == head:
                continue
            p, n = prev[k], nxt[k]  # unlink (k is not the head: p != -1)
            nxt[p] = n
            if n != -1:
                prev[n] = p
            else:
                tail = p
        else:
            if occ == cap:  # evict the least recently used
                v = tail
                tail = prev[v]
                if tail != -1:
                    nxt[tail] = -1
                else:
                    head = -1
                res[v] = False
            else:
                occ += 1
            res[k] = True
        prev[k] = -1  # push k at the head
        nxt[k] = head
        if head != -1:
            prev[head] = k
        head = k
        if tail == -1:
            tail = k
    return hits


def flat_lru_hits(ids: np.ndarray, n_keys: int, cache_slots: int) -> int:
    """Hits of LRU with ``cache_slots`` slots over ``ids`` (keys 0..n_keys-1, one per access):
    O(1) per access (a doubly linked list over the key ids)."""
    return int(_flat_lru(np.ascontiguousarray(ids, np.int64), np.int64(0), max(int(n_keys), 1),
                         int(cache_slots)))


@njit(cache=True, error_model="numpy", boundscheck=False)
def _next_uses(keys, lo, nxt, last):
    """``nxt[i]``: the next access index of key ``keys[i]`` (``len(keys) + 1``: never again;
    ``last`` over the key range, key ``keys[i] - lo``, starts at that)."""
    for i in range(keys.shape[0] - 1, -1, -1):
        k = keys[i] - lo
        nxt[i] = last[k]
        last[k] = i


@njit(cache=True, error_model="numpy", boundscheck=False)
def _flat_belady(nxt, cap, bits, off, nlev):
    """Belady's hits over the accesses whose next uses are ``nxt`` (:func:`_next_uses`), with
    ``cap`` slots. A resident key is the set bit at its next use's position in ``bits``, a
    ``nlev``-level bitmap over the accesses (level ``l`` at ``off[l]``: one bit per word of
    the level below, set while that word is not 0), so access i hits iff bit i is set and the
    farthest next use is the highest set bit, found in at most 2·``nlev`` word reads; a
    resident key never used again is only counted (``dead``: they go first, and which of them
    goes cannot change a hit count). No per-key table: 1/8 byte per access.

    ``top`` is the highest set bit when known (≥ 0), else every set bit is ≤ ``bound``: a key
    that comes in farther than the one just evicted is the new highest, so a run of misses
    whose keys come back late (a small cache, most accesses missing) looks nothing up. An
    unknown highest is searched from ``bound`` upwards, level by level, to the first word with
    a bit at or below it, then down: the words near ``bound`` were just written, and the next
    farthest is usually near it (3–10 % faster than from the root with 64–256 slots, the same
    elsewhere; scratch comparison, stop 50). With the cache full of live keys a set bit ≤
    ``bound`` exists, so the climb stops. Same hits as the binary heap of next uses it replaced
    (tested against the textbook Belady)."""
    n = nxt.shape[0]
    one = np.uint64(1)
    full = np.uint64(0xFFFFFFFFFFFFFFFF)
    size = 0
    dead = 0
    hits = 0
    top = -1
    bound = -1
    for i in range(n):
        v = nxt[i]
        if (bits[i >> 6] >> np.uint64(i & 63)) & one:  # hit: its bit at i goes
            hits += 1
            p = i
            if top == i:
                top = -1
                bound = i
        elif size < cap:
            size += 1
            p = -1
        elif dead > 0:
            dead -= 1
            p = -1
        else:  # evict the farthest next use: the highest set bit
            if top < 0:  # the highest set bit at or below ``bound``: up from bound's word
                q = bound  # (just written: in cache) to the first level with one, then down
                lev = 0
                while True:
                    w = bits[off[lev] + (q >> 6)] & (full >> np.uint64(63 - (q & 63)))
                    if w != 0:
                        q = ((q >> 6) << 6) | (63 - leading_zeros(w))
                        break
                    q = (q >> 6) - 1  # the words before this one, at the level above
                    lev += 1
                while lev > 0:
                    lev -= 1
                    q = (q << 6) | (63 - leading_zeros(bits[off[lev] + q]))
                top = q
            p = top
            top = -1
            bound = p
        if p >= 0:  # clear bit p, and each level's bit of a word that became 0
            for lev in range(nlev):
                a = off[lev] + (p >> 6)
                w = bits[a] & ~(one << np.uint64(p & 63))
                bits[a] = w
                if w != 0:
                    break
                p >>= 6
        if v >= n:  # never used again
            dead += 1
        else:  # resident until its next use: its bit at v
            if v > top if top >= 0 else v > bound:
                top = v
            p = v
            for lev in range(nlev):
                a = off[lev] + (p >> 6)
                w = bits[a]
                bits[a] = w | (one << np.uint64(p & 63))
                if w != 0:
                    break
                p >>= 6
    return hits


#: the widest key range (``max - min + 1`` of the keys) that the flat kernels reading keys as
#: they are (:func:`belady_hits`, :func:`lru_hits`) index directly, beyond the trace's own
#: length / 4: their per-key tables (Belady's one of at most 8 bytes, LRU's 17 bytes) then
#: add at most ~5 bytes per access; sparser keys are relabelled first (:func:`dense_keys`)
DENSE_SPAN_SLACK = 1 << 16


def flat_belady_hits(ids: np.ndarray, n_keys: int, cache_slots: int) -> int:
    """Hits of Belady's MIN (always admitting, as libCacheSim's Belady) with ``cache_slots``
    slots over ``ids`` (keys 0..n_keys-1, one per access): next accesses by one backward pass,
    residents as the bits of their next accesses (:func:`_flat_belady`), a word per bitmap
    level per eviction (log₆₄ of the accesses)."""
    ids = np.ascontiguousarray(ids, np.int64)
    return _belady_tables(ids, 0, max(int(n_keys), 1), int(cache_slots))


def _key_range(keys: np.ndarray, bounds: tuple[int, int] | None = None
               ) -> tuple[np.ndarray, int, int] | None:
    """``(keys, lo, span)`` for integer ``keys`` whose range is dense enough to index tables
    by ``key - lo`` directly (at most ``len(keys) / 4 +`` :data:`DENSE_SPAN_SLACK` values, as
    every MoE trace's ``layer · E + expert``), read as they are (any integer width, no copy);
    None for sparser keys (they are relabelled: :func:`dense_keys`). ``bounds``: the keys'
    least and greatest (:func:`key_bounds`), when known."""
    keys = integer_keys(keys)
    if not keys.size:
        return keys, 0, 1
    lo, hi = bounds if bounds is not None else key_bounds(keys)
    span = hi - lo + 1  # Python ints: no overflow
    return (keys, lo, span) if span <= keys.size // 4 + DENSE_SPAN_SLACK else None


def lru_hits(keys: np.ndarray, cache_slots: int, bounds: tuple[int, int] | None = None
             ) -> int:
    """:func:`flat_lru_hits` of any integer ``keys``, read as they are where their range is
    dense (:func:`_key_range`): no int64 copy and no relabelling pass. ``bounds``: the keys'
    least and greatest, when known (:func:`key_bounds`)."""
    dense = _key_range(keys, bounds)
    if dense is None:
        ids, n_keys = dense_keys(keys, bounds)
        return flat_lru_hits(ids, n_keys, cache_slots)
    keys, lo, span = dense
    if not keys.size:
        return 0
    return int(_flat_lru(keys, np.int64(lo), span, max(1, min(int(cache_slots), span))))


def belady_hits(keys: np.ndarray, cache_slots: int, bounds: tuple[int, int] | None = None
                ) -> int:
    """:func:`flat_belady_hits` of any integer ``keys`` without copying or relabelling them
    when their range is dense (at most ``len(keys) / 4 +`` :data:`DENSE_SPAN_SLACK` values):
    besides the keys it allocates the next-access array, 4 bytes per access (8 past 2³¹ − 2
    accesses), and tables over the key range; so a ``uint16`` trace of 10⁹ accesses replays in
    about 6 GB. Sparser keys are relabelled by :func:`dense_keys` (an int64 copy).
    ``bounds``: the keys' least and greatest, when known (:func:`key_bounds`)."""
    dense = _key_range(keys, bounds)
    if dense is None:
        ids, n_keys = dense_keys(keys, bounds)
        return _belady_tables(ids, 0, n_keys, int(cache_slots))
    keys, lo, span = dense
    return _belady_tables(keys, lo, span, int(cache_slots))


def _belady_tables(keys: np.ndarray, lo: int, span: int, cache_slots: int) -> int:
    """Allocate :func:`_flat_belady`'s arrays (here, where ``tracemalloc`` sees them) at the
    narrowest width that holds their values, and run it."""
    n = keys.shape[0]
    if not n:
        return 0
    at = np.int32 if n + 1 <= np.iinfo(np.int32).max else np.int64  # access indices, n + 1
    cap = max(1, min(int(cache_slots), span))
    nxt = np.empty(n, at)
    _next_uses(keys, np.int64(lo), nxt, np.full(span, n + 1, at))
    words = [(n + 63) // 64]  # the bitmap's levels, down to one word
    while words[-1] > 1:
        words.append((words[-1] + 63) // 64)
    off = np.zeros(len(words), np.int64)
    off[1:] = np.cumsum(words)[:-1]
    return int(_flat_belady(nxt, cap, np.zeros(sum(words), np.uint64), off, len(words)))


@njit(cache=True, error_model="numpy", boundscheck=False)
def _flat_state(n_keys, cap, width):
    """The grouped kernel's state for one flat pool of ``cap`` slots over ``n_keys`` keys (one
    layer of ``n_keys`` experts): key slots, key flags, pool, and ``width`` policy words."""
    ks = np.full((n_keys, 8), -1, np.int64)
    kf = np.zeros((n_keys, 8), np.uint8)
    pl = np.zeros((1, 4), np.int64)
    pl[0, CAP] = cap
    aux = np.zeros(AUX_TURNS + 1 + width, np.int64)
    aux[AUX_L] = 1
    aux[AUX_E] = max(n_keys, 1)
    o = AUX_TURNS + 1
    for j in range(8):
        aux[o + j] = -1
    return ks, kf, pl, aux


@njit(cache=True, error_model="numpy", boundscheck=False)
def _flat_arc(ids, n_keys, cap):
    ks, kf, pl, aux = _flat_state(n_keys, cap, ARC_W)
    pp = np.zeros(1, np.float64)
    occ = 0
    hits = 0
    for i in range(ids.shape[0]):
        k = ids[i]
        if kf[k, RES]:
            hits += 1
            _arc_hit(k, 0, ks, kf, aux)
            continue
        if occ >= cap:
            x = _arc_victim(k, 0, ks, kf, pl, aux, pp)
            kf[x, RES] = 0
            _arc_gone(x, 0, ks, kf, aux)
        else:
            _arc_before(k, 0, ks, kf, pl, aux, pp)
            occ += 1
        kf[k, RES] = 1
        _arc_insert(k, 0, ks, kf, aux)
    return hits


def flat_arc_hits(ids: np.ndarray, n_keys: int, cache_slots: int) -> int:
    """Hits of ARC (as :class:`workbench.policies.eviction.ARC` and libCacheSim's) with
    ``cache_slots`` slots over ``ids`` (keys 0..n_keys-1, one per access): the grouped
    kernel's ARC helpers with nothing protected, O(1) per access."""
    return int(_flat_arc(np.ascontiguousarray(ids, np.int64), max(int(n_keys), 1),
                         int(cache_slots)))


@njit(cache=True, error_model="numpy", boundscheck=False)
def _flat_s3fifo(ids, n_keys, cap):
    ks, kf, pl, aux = _flat_state(n_keys, cap, S3_W)
    ks[:, COUNT] = 0
    occ = 0
    hits = 0
    for i in range(ids.shape[0]):
        k = ids[i]
        if kf[k, RES]:
            hits += 1
            ks[k, COUNT] += 1
            continue
        if occ >= cap:
            x = _s3_victim(k, 0, ks, kf, pl, aux)
            kf[x, RES] = 0
            _s3_gone(x, 0, ks, kf, pl, aux)
        else:
            _s3_before(k, 0, ks, kf, aux)
            occ += 1
        kf[k, RES] = 1
        _s3_insert(k, 0, ks, kf, pl, aux)
    return hits


def flat_s3fifo_hits(ids: np.ndarray, n_keys: int, cache_slots: int) -> int:
    """Hits of S3-FIFO (as :class:`workbench.policies.eviction.S3FIFO`; libCacheSim's from 20
    slots on) with ``cache_slots`` slots over ``ids`` (keys 0..n_keys-1, one per access): the
    grouped kernel's S3-FIFO helpers with nothing protected."""
    return int(_flat_s3fifo(np.ascontiguousarray(ids, np.int64), max(int(n_keys), 1),
                            int(cache_slots)))
