"""Test-only: any Hub dataset id streams local parquet files instead, through train.py's own streaming path
(`data.streaming.open_hub_stream` on parquet files, datasets' IterableDataset and its state_dict), offline, for an
in-process run. Never imported by the product."""
from __future__ import annotations

import pytest


def stream_local_parquet(files: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Point `data.source` and `data.streaming` at `files` for every Hub id, at a fixed commit (no Hub to ask),
    until `monkeypatch` undoes it."""
    import data.source as source
    import data.streaming as streaming
    from data.hub import HubData

    open_hub_stream = streaming.open_hub_stream

    def open_local_parquet(name, config, split="train", data_files=None, revision=None):
        return open_hub_stream("parquet", None, "train", data_files=files)

    monkeypatch.setattr(streaming, "open_hub_stream", open_local_parquet)  # where it is defined and where it is used
    monkeypatch.setattr(source, "open_hub_stream", open_local_parquet)
    monkeypatch.setattr(source, "locate_hub_dataset", lambda name, config, revision: HubData(name, "0" * 40, config))
