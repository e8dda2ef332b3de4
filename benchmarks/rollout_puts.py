"""Run: `PYTHONPATH=. python benchmarks/rollout_puts.py` (starts a local Ray). Rollout host's puts per 0.6m step: 64 completions, per completion (2 puts each, before) vs per poll round (2 puts a
round, after; 1 round and 4 rounds), the real pack_completion / pack_round, timed inside an actor."""
import time, statistics, ray, torch
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
from megarl.data.token_rows import pack_completion, pack_round

@ray.remote(num_cpus=0)
class Host:
    def step(self, n, p, r, rounds):
        t = time.perf_counter()
        packs = [pack_completion(list(range(p)), list(range(r)), [0.5] * r) for _ in range(n)]
        puts = 0
        if rounds == 0:
            refs = [(ray.put(i), ray.put(l)) for i, l in packs]; puts = 2 * n
        else:
            k = n // rounds
            for j in range(rounds):
                ids, lps = zip(*packs[j * k:(j + 1) * k])
                refs = (ray.put(pack_round(ids)), ray.put(pack_round(lps))); puts += 2
        return time.perf_counter() - t, puts

h = Host.remote()
for n, p, r in ((64, 8, 16), (64, 8, 64)):
    for rounds in (0, 1, 4):
        out = [ray.get(h.step.remote(n, p, r, rounds)) for _ in range(8)][1:]
        ts = [o[0] for o in out]
        what = "per completion" if rounds == 0 else f"{rounds} poll round(s)"
        print(f"{n} completions (P {p}, R {r}), {what}: {out[0][1]} puts, median {statistics.median(ts)*1e3:.1f} ms, "
              f"min {min(ts)*1e3:.1f} ms per step")
ray.shutdown()
