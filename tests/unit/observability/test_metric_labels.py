"""Label budgets a client cannot exhaust (issue 70, item 9): fairness ids have their own
budget, and a model name past the label length is looked up as it is stored."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from epp.observability.metrics import MAX_LABEL_CHARS, MAX_MODEL_LABELS, OTHER_MODEL, EppMetrics


def test_fairness_ids_do_not_use_up_the_model_labels() -> None:
    m = EppMetrics(CollectorRegistry())
    m.request_done("llama", "200")
    for i in range(3 * MAX_MODEL_LABELS):  # a client inventing x-llm-d-inference-fairness-id values
        m.flow_left(f"tenant-{i}", 0, "dispatched", "llama", "llama", 0.01)
    assert m.model_label("llama") == "llama"
    assert m.model_label("mistral") == "mistral"  # room for real models is intact
    flows = {s.labels["fairness_id"] for fam in m.registry.collect()
             if fam.name == "inference_extension_flow_control_request_queue_duration_seconds"
             for s in fam.samples if "fairness_id" in s.labels}  # fmt: skip
    assert len(flows) == 101 and OTHER_MODEL in flows


def test_a_long_model_name_keeps_its_label_once_the_budget_is_spent() -> None:
    m = EppMetrics(CollectorRegistry())
    long_name = "org/" + "m" * 300
    first = m.model_label(long_name)
    assert first == long_name[:MAX_LABEL_CHARS]
    for i in range(MAX_MODEL_LABELS):
        m.model_label(f"model-{i}")
    assert m.model_label(long_name) == first  # not "other": looked up as it was stored
    assert m.model_label("late") == OTHER_MODEL
