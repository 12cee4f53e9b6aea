"""HellaSwag accuracies from per-ending log-likelihoods, as an `evaluate` metric.

The one definition of acc / acc_norm / acc_norm_tokens in this project: `eval.hellaswag` scores
the endings and computes its accuracies by loading this folder (offline, no Hub access):

    import evaluate
    metric = evaluate.load("/abs/path/to/eval/metrics/hellaswag_acc")
    metric.compute(predictions=[[ll0, ll1, ll2, ll3], ...], references=[label, ...],
                   choice_lengths=[[chars0, ...], ...], token_counts=[[n0, ...], ...])

acc = argmax of the summed log-likelihood; acc_norm = argmax of log-likelihood / ending length in
characters (lm-evaluation-harness); acc_norm_tokens = argmax of log-likelihood / ending tokens
(build-nanogpt, llm.c). Lengths below 1 count as 1. Ties go to the first ending (np.argmax).
Each accuracy is the float64 mean of 0/1 correctness, i.e. exactly (number correct) / n: it does
not depend on the order of the items.
"""
import datasets
import evaluate
import numpy as np

_DESCRIPTION = "HellaSwag acc / acc_norm / acc_norm_tokens from per-ending log-likelihoods."
_INPUTS = """
predictions: list of per-item lists of ending log-likelihoods (sum over the ending's tokens).
references: list of gold ending indices.
choice_lengths: per-item lists of ending lengths in characters, without the leading space
    (needed for acc_norm).
token_counts: per-item lists of ending token counts (needed for acc_norm_tokens).
Returns: {"n", "acc"} plus "acc_norm" / "acc_norm_tokens" when their lengths are given.
"""


class HellaswagAcc(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_INPUTS,
            features=datasets.Features({
                "predictions": datasets.Sequence(datasets.Value("float64")),
                "references": datasets.Value("int64"),
            }),
        )

    def _compute(self, predictions, references, choice_lengths=None, token_counts=None):
        lls = np.asarray(predictions, dtype=np.float64)
        labels = np.asarray(references, dtype=np.int64)
        result = {"n": len(labels), "acc": float((lls.argmax(axis=1) == labels).mean())}
        for key, lengths in (("acc_norm", choice_lengths), ("acc_norm_tokens", token_counts)):
            if lengths is not None:
                norm = lls / np.maximum(np.asarray(lengths, dtype=np.float64), 1)
                result[key] = float((norm.argmax(axis=1) == labels).mean())
        return result
