"""The demo task's metrics: the evaluation stage's metric file when the dataset is 'demo'.

    python -m tasks.eval ... --metric_func tasks/data/demo_metrics.py

accuracy: the three-digit answer read out of the response, in either style, equals the label.
preferred_style_rate: the response is in the terse style the demo's reward model learns to prefer.
The evaluation reports each on greedy responses (`accuracy`) and on samples (`sampled_accuracy`).
"""

from tasks.data.demo import extract_answer, is_preferred_style


def metrics(prompts, responses, labels, rows):
    out = {}
    if labels is not None:
        out["accuracy"] = [
            None if label is None else float(extract_answer(r) == label) for r, label in zip(responses, labels)
        ]
    out["preferred_style_rate"] = [float(is_preferred_style(r)) for r in responses]
    return out
