"""Train the CPU quickstart's tiny model from Python: a reward written as a closure, records in memory."""
import json

import megarl

records = [json.loads(line) for line in open("data/quickstart/train.jsonl")]
targets = set(records[0]["answer"].split())  # the task: answer with the target words


def reward(response: str, answer, record) -> float:  # any callable: fn(response_text, answer, record) -> float
    words = response.split()
    return sum(w in targets for w in words) / len(words) if words else 0.0


with megarl.RLTrainer(
    "yaml_configs/cpu_quickstart.yaml",  # the tiny model and 2-process layout; keywords override it
    reward=reward,
    train_data=records,  # a list of dicts, or a .jsonl / .parquet path
    algorithm="grpo",
    actor={"tp": 2, "lr": 3e-3},  # shorthand for actor.parallel.tp and actor.optimizer.lr
    trainer={"total_steps": 3},
    run_dir="runs/api_quickstart",
) as trainer:
    metrics = trainer.step()  # one RL step; returns its metrics (the row of metrics.jsonl)
    print(f"step {metrics['step']}: reward {metrics['reward/mean']:.3f} kl {metrics['actor/kl']:.4f}")
    trainer.fit()  # the remaining steps; summary table and plots in runs/api_quickstart/plots
    print("generated:", json.dumps(trainer.generate([records[0]["prompt"]])))  # greedy, through vLLM
    print("exported:", trainer.export_hf("runs/api_quickstart/hf", overwrite=True)["out"])
