"""CPU model of `_dw_pair_ws_kernel`'s barrier protocol (tools/gluon_dw.py): the loader and compute partitions
as generators over mbarriers with PTX parity semantics, TMA loads landing and TMA stores reading at random later
times, a random scheduler. Checks that no schedule deadlocks, that every wgmma reads the blocks of its own K step
(not overwritten before it retired), that the epilogue reads the tile's own C blocks, and that no C load lands in
hi_s / lo_s before the previous tile's stores have read them.

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
                # warpgroup_mma_wait(1): all but the newest retire
                for s, tag in pending[:-1]:
                    assert ring[s] == tag, f"stage {s} overwritten under its wgmma {tag}"
                    del reading[s]
                pending = pending[-1:]
                if kk > 0:
                    empty[(step + stages - 1) % stages].arrive()
                step += 1
                yield
            for s, tag in pending:
                assert ring[s] == tag
                del reading[s]
            empty[(step + stages - 1) % stages].arrive()
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

    parts = {"loader": loader(), "compute": compute()}
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


def main():
    runs = 0
    for stages, n_k, tiles, first in itertools.product([2, 3, 4, 5], [1, 2, 3, 5, 8], [1, 2, 3, 5], [True, False]):
        for c_free_step in sorted({-1, 0, min(1, stages - 2), stages - 2}):
            for seed in range(6):
                simulate(tiles, n_k, stages, first, c_free_step, seed)
                runs += 1
    print(f"{runs} random schedules: no deadlock, every wgmma and epilogue read its own blocks")


if __name__ == "__main__":
    main()
