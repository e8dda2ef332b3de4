"""The rollout host's object-store puts per 0.6m `vs_trl` step: 64 completions put per completion (two objects
each, before) or per poll round (two objects a round, `pack_round`; 1 and 4 rounds), with the real
`pack_completion` / `pack_round`, timed inside a Ray actor. Starts a local Ray: run under the heavy lock.

    PYTHONPATH=. python benchmarks/rollout_puts.py
"""

import statistics
import time

import ray

from megarl.data.token_rows import pack_completion, pack_round


@ray.remote(num_cpus=0)
class Host:
    def step(self, n: int, prompt: int, response: int, rounds: int) -> tuple[float, int]:
        """(seconds, puts) of one step's packing and puts; rounds 0: per completion."""
        t = time.perf_counter()
        packs = [pack_completion(list(range(prompt)), list(range(response)), [0.5] * response) for _ in range(n)]
        puts, refs = 0, []
        if rounds == 0:
            refs = [(ray.put(i), ray.put(lp)) for i, lp in packs]
            puts = 2 * n
        else:
            k = n // rounds
            for j in range(rounds):
                ids, lps = zip(*packs[j * k:(j + 1) * k])
                refs.append((ray.put(pack_round(ids)), ray.put(pack_round(lps))))
                puts += 2
        return time.perf_counter() - t, puts


def main() -> None:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    h = Host.remote()
    for n, p, r in ((64, 8, 16), (64, 8, 64)):
        for rounds in (0, 1, 4):
            out = [ray.get(h.step.remote(n, p, r, rounds), timeout=300) for _ in range(8)][1:]
            ts = [o[0] for o in out]
            what = "per completion" if rounds == 0 else f"{rounds} poll round(s)"
            print(f"{n} completions (P {p}, R {r}), {what}: {out[0][1]} puts, median "
                  f"{statistics.median(ts) * 1e3:.1f} ms, min {min(ts) * 1e3:.1f} ms per step")
    ray.shutdown()


if __name__ == "__main__":
    main()
