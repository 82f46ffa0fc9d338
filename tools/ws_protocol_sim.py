"""CPU model of `_dw_pair_ws_kernel`'s and `_dw_pair_pp_kernel`'s barrier protocols (tools/gluon_dw.py): the loader
and compute partitions as generators over mbarriers with PTX parity semantics, TMA loads landing and TMA stores
reading at random later times, a random scheduler. Checks that no schedule deadlocks, that every wgmma reads the
blocks of its own K step (not overwritten before it retired), that the epilogue reads the tile's own C blocks, and
that no C load lands in hi_s / lo_s before the previous tile's stores have read them.

    python tools/ws_protocol_sim.py   (a development tool)
"""
import itertools
import random


class MBarrier:
    """count-1 mbarrier: a phase completes once its one arrival came and its expected bytes landed."""

    def __init__(self):
        self.phase = 0  # the phase in progress
        self.arrived = 0
        self.tx = 0

    def arrive(self, tx=0):
        self.arrived += 1
        self.tx += tx
        assert self.arrived == 1, "a second arrival in one phase (count 1)"
        self._complete()

    def land(self, nbytes):
        self.tx -= nbytes
        self._complete()

    def _complete(self):
        if self.arrived == 1 and self.tx == 0:
            self.phase += 1
            self.arrived = 0

    def done(self, parity):
        """try_wait.parity: the phase of that parity before the current one has completed."""
        return (self.phase & 1) != parity


def _retire(pending, keep, ring, reading):
    """warpgroup_mma_wait(keep): all but the newest `keep` of the pending wgmma (slot, tag) retire, each having
    read its own step's blocks; returns those still in flight."""
    for s, tag in pending[:len(pending) - keep]:
        assert ring[s] == tag, f"stage {s} overwritten under its wgmma {tag}"
        del reading[s]
    return pending[len(pending) - keep:]


def _retire_previous(pending, empty, step, has_previous, stages, ring, reading):
    """The kernels' `_retire_previous` after step `step`'s wgmma: warpgroup_mma_wait(1), then the previous step's
    stage freed where the tile had one; returns the wgmma still in flight."""
    pending = _retire(pending, 1, ring, reading)
    if has_previous:
        empty[(step + stages - 1) % stages].arrive()
    return pending


def _retire_last(pending, empty, step, stages, ring, reading):
    """The kernels' `_retire_last` (`step` one past the tile's last): every wgmma retired, the last stage freed."""
    _retire(pending, 0, ring, reading)
    empty[(step + stages - 1) % stages].arrive()


def simulate(n_tiles_prog, n_k, stages, first, c_free_step, seed):
    rng = random.Random(seed)
    ready = [MBarrier() for _ in range(stages)]
    empty = [MBarrier() for _ in range(stages)]
    c_ready, c_free = MBarrier(), MBarrier()
    ring = [None] * stages  # the (tile, k) whose blocks a stage holds
    hi_s = [None]  # the tile whose C blocks (or epilogue result) hi_s holds
    in_flight = []  # [(action, ...)]: TMA loads to land, stores to read
    stores_unread = [0]
    reading = {}  # stage -> (tile, k) that an unretired wgmma reads

    def tma_load_stage(slot, tag):
        in_flight.append(("stage", slot, tag))

    def loader():
        step = 0
        for d in range(n_tiles_prog):
            c_at = min(n_k - 1, stages - 2)
            for kk in range(n_k):
                slot = step % stages
                while not empty[slot].done(((step // stages) & 1) ^ 1):
                    yield
                ready[slot].arrive(tx=2)
                tma_load_stage(slot, (d, kk))
                if not first and kk == c_at:
                    while not c_free.done((d & 1) ^ 1):
                        yield
                    c_ready.arrive(tx=2)
                    in_flight.append(("c", d))
                step += 1
                yield

    def compute():
        step = 0
        for d in range(n_tiles_prog):
            free_at = min(n_k - 1, c_free_step)
            pending = []  # unretired wgmma: (slot, tag)
            for kk in range(n_k):
                slot = step % stages
                while not ready[slot].done((step // stages) & 1):
                    yield
                assert ring[slot] == (d, kk), f"wgmma of {(d, kk)} reads {ring[slot]}"
                pending.append((slot, (d, kk)))
                reading[slot] = (d, kk)
                if not first and c_free_step >= 0 and kk == free_at:
                    while stores_unread[0]:
                        yield
                    if d > 0:
                        c_free.arrive()
                pending = _retire_previous(pending, empty, step, kk > 0, stages, ring, reading)
                step += 1
                yield
            _retire_last(pending, empty, step, stages, ring, reading)
            if first:
                while stores_unread[0]:
                    yield
            else:
                while not c_ready.done(d & 1):
                    yield
                assert hi_s[0] == ("C", d), f"epilogue of tile {d} reads {hi_s[0]}"
            hi_s[0] = ("out", d)
            stores_unread[0] += 2
            in_flight.append(("store",))
            in_flight.append(("store",))
            if not first and c_free_step < 0:
                while stores_unread[0]:
                    yield
                c_free.arrive()
            yield
        while stores_unread[0]:
            yield

    def progress_async():
        """One in-flight TMA operation (a random one) completes."""
        if not in_flight:
            return False
        op = in_flight.pop(rng.randrange(len(in_flight)))
        if op[0] == "stage":
            _, slot, tag = op
            assert slot not in reading, f"load of {tag} lands on stage {slot} under wgmma {reading.get(slot)}"
            ring[slot] = tag
            ready[slot].land(2)
        elif op[0] == "c":
            assert stores_unread[0] == 0, f"C load of tile {op[1]} lands while stores still read hi_s"
            hi_s[0] = ("C", op[1])
            c_ready.land(2)
        else:
            stores_unread[0] -= 1
        return True

    _run(rng, {"loader": loader(), "compute": compute()}, progress_async, in_flight)

def _run(rng, parts, progress_async, in_flight):
    """Random interleaving of the partitions' generators and the TMA unit until all finish; a deadlock is a long
    run of rounds in which nothing lands while nothing is in flight."""
    live = dict(parts)
    idle_rounds = 0
    while live:
        choices = list(live) + ["async"] * 2
        who = rng.choice(choices)
        if who == "async":
            moved = progress_async()
        else:
            try:
                next(live[who])
                moved = True  # a generator step may only re-check its condition; deadlock shows as a long idle run
            except StopIteration:
                del live[who]
                moved = True
        idle_rounds = 0 if moved and who == "async" else idle_rounds + 1
        if idle_rounds > 10000 and not in_flight:
            raise RuntimeError(f"deadlock: {sorted(live)} blocked, nothing in flight")
    assert not in_flight or all(op[0] == "store" for op in in_flight)


def simulate_pingpong(n_tiles_prog, n_k, stages, first, seed, shared_ready=False):
    """`_dw_pair_pp_kernel`'s protocol: a loader, two compute owners taking the program's tiles in turns (tile i to
    owner i % 2), one ring, per owner its ready barriers (or one shared set: `shared_ready`, the unsafe variant),
    its hi_s / lo_s and its c_ready / c_free."""
    rng = random.Random(seed)
    ready = [[MBarrier() for _ in range(stages)]] * 2 if shared_ready else \
        [[MBarrier() for _ in range(stages)] for _ in range(2)]
    empty = [MBarrier() for _ in range(stages)]
    c_ready, c_free = [MBarrier(), MBarrier()], [MBarrier(), MBarrier()]
    ring = [None] * stages  # the (tile, k) whose blocks a stage holds
    hi_s = [None, None]  # per owner: the tile whose C blocks (or epilogue result) its hi_s holds
    in_flight = []
    stores_unread = [0, 0]  # per owner: its stores that have not read its hi_s / lo_s
    reading = {}  # stage -> (tile, k) that an unretired wgmma reads

    def loader():
        step = 0
        c_at = min(n_k - 1, stages - 2)
        for i in range(n_tiles_prog):
            o = i % 2
            for kk in range(n_k):
                slot = step % stages
                while not empty[slot].done(((step // stages) & 1) ^ 1):
                    yield
                ready[o][slot].arrive(tx=2)
                in_flight.append(("stage", slot, (i, kk), ready[o][slot]))
                if not first and kk == c_at:
                    while not c_free[o].done(((i // 2) & 1) ^ 1):
                        yield
                    c_ready[o].arrive(tx=2)
                    in_flight.append(("c", o, i))
                step += 1
                yield

    def compute(o):
        phases = 0  # bit s: the parity of ready[o][s]'s next phase
        for j, i in enumerate(range(o, n_tiles_prog, 2)):
            step = i * n_k
            pending = []  # unretired wgmma: (slot, tag)
            for kk in range(n_k):
                slot = step % stages
                parity = ((step // stages) & 1) if shared_ready else (phases >> slot) & 1
                while not ready[o][slot].done(parity):
                    yield
                phases ^= 1 << slot
                assert ring[slot] == (i, kk), f"owner {o}: wgmma of {(i, kk)} reads {ring[slot]}"
                assert slot not in reading, f"stage {slot} read by two wgmma"
                pending.append((slot, (i, kk)))
                reading[slot] = (i, kk)
                if not first and kk == 0:
                    while stores_unread[o]:
                        yield
                    if j > 0:
                        c_free[o].arrive()
                pending = _retire_previous(pending, empty, step, kk > 0, stages, ring, reading)
                step += 1
                yield
            _retire_last(pending, empty, step, stages, ring, reading)
            if first:
                while stores_unread[o]:
                    yield
            else:
                while not c_ready[o].done(j & 1):
                    yield
                assert hi_s[o] == ("C", i), f"owner {o}: epilogue of tile {i} reads {hi_s[o]}"
            hi_s[o] = ("out", i)
            stores_unread[o] += 2
            in_flight.extend([("store", o), ("store", o)])
            yield
        while stores_unread[o]:
            yield

    def progress_async():
        if not in_flight:
            return False
        op = in_flight.pop(rng.randrange(len(in_flight)))
        if op[0] == "stage":
            _, slot, tag, bar = op
            assert slot not in reading, f"load of {tag} lands on stage {slot} under wgmma {reading.get(slot)}"
            ring[slot] = tag
            bar.land(2)
        elif op[0] == "c":
            _, o, i = op
            assert stores_unread[o] == 0, f"C load of tile {i} lands while owner {o}'s stores still read hi_s"
            hi_s[o] = ("C", i)
            c_ready[o].land(2)
        else:
            stores_unread[op[1]] -= 1
        return True

    _run(rng, {"loader": loader(), "owner 0": compute(0), "owner 1": compute(1)}, progress_async, in_flight)


def main():
    runs = 0
    for stages, n_k, tiles, first in itertools.product([2, 3, 4, 5], [1, 2, 3, 5, 8], [1, 2, 3, 5], [True, False]):
        for c_free_step in sorted({-1, 0, min(1, stages - 2), stages - 2}):
            for seed in range(6):
                simulate(tiles, n_k, stages, first, c_free_step, seed)
                runs += 1
    print(f"{runs} random schedules: no deadlock, every wgmma and epilogue read its own blocks")
    runs = 0
    for stages, n_k, tiles, first in itertools.product([2, 3, 4, 5, 7], [1, 2, 3, 5, 8], [1, 2, 3, 4, 5, 7],
                                                       [True, False]):
        for seed in range(6):
            simulate_pingpong(tiles, n_k, stages, first, seed)
            runs += 1
    print(f"ping-pong: {runs} random schedules: no deadlock, every wgmma and epilogue read its own blocks")
    # the control: with one ready barrier per stage shared by the owners, some schedule must go wrong
    failures = 0
    for seed in range(200):
        try:
            simulate_pingpong(4, 5, 3, False, seed, shared_ready=True)
        except AssertionError:
            failures += 1
    print(f"ping-pong with shared ready barriers (unsafe): {failures} of 200 schedules read the wrong blocks")
    assert failures, "the model no longer catches the shared ready barrier's early pass"


if __name__ == "__main__":
    main()
