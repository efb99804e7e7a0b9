"""What megadyn/elastic reads of the job's config is declared on types of megadyn/elastic/config.py
(Protocols of the training package's sections); the training package's config has every
attribute they declare, with the section types elastic expects (pure; no processes)."""

import inspect

from megadyn.elastic import config as elastic_config
from megadyn.elastic.config import ElasticConfig, JobConfig
from megadyn.models.config import GPTConfig
from megadyn.training import config as training_config
from megadyn.training.config import MegadynConfig


def declared(protocol) -> list[str]:
    return [n for n, v in vars(protocol).items() if isinstance(v, property)]


def test_the_job_config_has_what_elastic_declares():
    cfg = MegadynConfig()
    assert training_config.ElasticConfig is ElasticConfig  # the training package re-imports it
    assert isinstance(cfg.model, GPTConfig) and isinstance(cfg.elastic, ElasticConfig)
    views = {
        name: inspect.signature(getattr(JobConfig, name).fget).return_annotation
        for name in declared(JobConfig)
    }
    assert views["parallel"] == "ParallelView" and views["training"] == "TrainingView"
    for section, view in views.items():
        protocol = getattr(elastic_config, view, None)
        if protocol is None:  # GPTConfig, ElasticConfig: the types themselves
            continue
        for name in declared(protocol):
            assert hasattr(getattr(cfg, section), name), f"cfg.{section}.{name}"
