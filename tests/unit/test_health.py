"""The learning-health notes at the end of a run and in the report: each fires on the curve it
describes, and a healthy run gets none."""

from plait.config import load_config
from plait.telemetry.advice import health_notes


CFG = load_config(None, ["train.learning_rate=3e-5"])


def rounds(**series):
    n = len(next(iter(series.values())))
    return [{"step": i + 1, **{k.replace("__", "/"): v[i] for k, v in series.items()}} for i in range(n)]


def test_a_healthy_run_gets_no_notes():
    rising = [0.1 * i for i in range(12)]
    history = rounds(reward__total__mean=rising, entropy=[1.0] * 12, clip__fraction=[0.05] * 12, grad_norm=[1.0] * 12)
    evals = [{"step": 0, "accuracy": 0.1}, {"step": 12, "accuracy": 0.5}]
    assert health_notes(history, evals, CFG, "accuracy") == []
    assert health_notes(history[:3], [], CFG, "accuracy") == []  # too short to say anything


def test_each_note_fires_on_its_curve():
    peak_then_collapse = [0.0, 0.2, 0.5, 0.7, 0.72, 0.7, 0.5, 0.3, 0.1, 0.06, 0.06, 0.06]
    history = rounds(
        reward__total__mean=peak_then_collapse,
        entropy=[1.0] * 4 + [0.5] * 4 + [0.1] * 4,
        clip__fraction=[0.05] * 4 + [0.2] * 4 + [0.4] * 4,
        grad_norm=[1.0] * 4 + [2.0] * 4 + [5.0] * 4,
    )
    evals = [{"step": 0, "accuracy": 0.1}, {"step": 5, "accuracy": 0.6}, {"step": 12, "accuracy": 0.2}]
    text = "\n".join(health_notes(history, evals, CFG, "accuracy"))
    assert "the reward fell from its peak" in text and "train.learning_rate (now 3e-05)" in text
    assert "the evaluation (accuracy) peaked at 0.600 (round 5) and ended at 0.200" in text
    assert "entropy collapsed (1.000 -> 0.100" in text
    assert "clipped share of tokens climbed (0.05 -> 0.40)" in text
    assert "gradient norm climbed (1 -> 5" in text
