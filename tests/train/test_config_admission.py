"""The config's tables.admission: each kind parsed and built into its veloce.admission
object (one per table), wrong combinations refused naming the field, a clear error where
veloce has no veloce.admission, and the Criteo example config."""

from __future__ import annotations

import inspect
import sys
import types
from pathlib import Path

import pytest
import torch

import veloce
from veloce.train import build
from veloce.train.build import build_admission, build_model
from veloce.train.config import AdmissionConfig, ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]


def admission(raw: dict) -> AdmissionConfig:
    return parse_config({"tables": {"admission": raw}}).tables.admission


@pytest.fixture
def fake_admission(monkeypatch):
    """A veloce.admission stand-in that records how its objects were made."""
    made: list[tuple[str, tuple, dict]] = []

    def kind(name):
        def make(*args, **kwargs):
            made.append((name, args, kwargs))
            return types.SimpleNamespace(kind=name, args=args, kwargs=kwargs)

        return make

    module = types.SimpleNamespace(Frequency=kind("Frequency"), Probability=kind("Probability"))
    monkeypatch.setattr(veloce, "admission", module, raising=False)
    return made


def test_admission_defaults_to_none():
    cfg = parse_config({}).tables.admission
    assert cfg == AdmissionConfig() and cfg.kind == "none" and build_admission(cfg) is None


def test_frequency_and_probability_build_their_objects(fake_admission):
    a = build_admission(admission({"kind": "frequency", "min_count": 2}))
    b = build_admission(admission({"kind": "frequency", "min_count": 3, "width": 4096, "depth": 2, "seed": 5}))
    c = build_admission(admission({"kind": "probability", "p": 0.25, "seed": 1}))
    d = build_admission(admission({"kind": "probability", "p": 1}))
    assert fake_admission == [
        ("Frequency", (2,), {}), ("Frequency", (3,), {"width": 4096, "depth": 2, "seed": 5}),
        ("Probability", (0.25,), {"seed": 1}), ("Probability", (1,), {}),
    ]  # fmt: skip
    assert a is not build_admission(admission({"kind": "frequency", "min_count": 2}))  # a fresh one per table
    assert (b.kind, c.kind, d.kind) == ("Frequency", "Probability", "Probability")


def test_each_table_gets_its_own_admission(fake_admission, monkeypatch):
    given = []

    class Table(torch.nn.Module):
        def __init__(self, dim, admission=None, **kwargs):
            super().__init__()
            given.append(admission)
            self.dim = dim

        def forward(self, ids, offsets):  # (never called)
            raise AssertionError

    monkeypatch.setattr(build, "DynamicEmbedding", Table)
    build_model(parse_config({"data": {"num_sparse": 3}, "tables": {"admission": {"kind": "frequency",
                                                                                  "min_count": 2}}}),
                torch.device("cpu"))  # fmt: skip
    assert len(given) == 3 and len({id(a) for a in given}) == 3 and all(a.args == (2,) for a in given)
    given.clear()
    build_model(parse_config({"data": {"num_sparse": 2}}), torch.device("cpu"))
    assert given == [None, None]  # kind none: no admission argument


@pytest.mark.parametrize("raw, match", [
    ({"kind": "frequency"}, "tables.admission.min_count must be set with kind frequency"),
    ({"kind": "frequency", "min_count": 0}, "tables.admission.min_count must be a positive number, got 0"),
    ({"kind": "frequency", "min_count": 2, "p": 0.5}, "tables.admission.p must be null with kind frequency"),
    ({"kind": "frequency", "min_count": 2, "width": -1}, "tables.admission.width must be a positive number"),
    ({"kind": "frequency", "min_count": 1.5}, "tables.admission.min_count must be an integer, got 1.5"),
    ({"kind": "probability"}, "tables.admission.p must be set with kind probability"),
    ({"kind": "probability", "p": 0}, r"tables.admission.p must be a probability in \(0, 1\]"),
    ({"kind": "probability", "p": 1.5}, r"tables.admission.p must be a probability in \(0, 1\].*, got 1.5"),
    ({"kind": "probability", "p": 0.5, "min_count": 2}, "tables.admission.min_count must be null with kind prob"),
    ({"kind": "none", "min_count": 2}, "tables.admission.min_count must be null with kind none"),
    ({"kind": "bloom"}, "tables.admission.kind must be one of none, frequency, probability, got 'bloom'"),
    ({"kind": "frequency", "min_cout": 2}, r"unknown field tables.admission.min_cout \(did you mean min_count"),
])  # fmt: skip
def test_bad_admission_names_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({"tables": {"admission": raw}})


def test_a_veloce_without_admission_is_a_clear_config_error(monkeypatch):
    monkeypatch.setattr(veloce, "admission", None, raising=False)
    monkeypatch.setitem(sys.modules, "veloce.admission", None)  # import veloce.admission fails
    with pytest.raises(ConfigError, match=r"tables.admission.kind is 'frequency', but this veloce has no "
                                          r"veloce.admission.*set tables.admission.kind: none"):  # fmt: skip
        build_admission(admission({"kind": "frequency", "min_count": 2}))


def test_the_criteo_admission_example_parses():
    cfg = load_config(ROOT / "configs" / "dlrm_criteo_admission.yaml")
    assert cfg.tables.admission == AdmissionConfig(kind="frequency", min_count=2)
    assert cfg.data.kind == "criteo" and cfg.data.path.endswith("criteo_kaggle_train_sample.tsv")
    cfg = load_config(ROOT / "configs" / "dlrm_criteo_admission.yaml", ["tables.admission.min_count=3"])
    assert cfg.tables.admission.min_count == 3


def test_the_config_builds_real_admission_when_veloce_has_it():
    if "admission" not in inspect.signature(veloce.DynamicEmbedding).parameters:
        pytest.skip("this veloce's DynamicEmbedding takes no admission")
    module = pytest.importorskip("veloce.admission")
    emb = build_model(parse_config({"data": {"num_sparse": 1}, "tables": {"admission": {"kind": "frequency",
                                                                                        "min_count": 2}}}),
                      torch.device("cpu")).embeddings["sparse_0"]  # fmt: skip
    assert isinstance(emb, veloce.DynamicEmbedding) and module.Frequency is not None
