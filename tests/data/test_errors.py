"""Data errors keep their one-line message when a DataLoader worker raises them."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DataLoader, Dataset

from data.errors import CorruptDataError, DataUnavailableError


class _Broken(Dataset):
    def __init__(self, error: Exception) -> None:
        self.error = error

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        raise self.error


@pytest.mark.parametrize("error", [
    CorruptDataError(Path("/data/train/cat/3.jpg"), "is not a readable image", "re-download it"),
    DataUnavailableError("images in /data/train/cat", "make data"),
])
def test_error_from_a_worker_process_arrives_with_its_type_and_one_line(error: Exception) -> None:
    loader = DataLoader(_Broken(error), batch_size=1, num_workers=1)
    with pytest.raises(type(error)) as caught:
        next(iter(loader))
    assert str(caught.value) == str(error) and "\n" not in str(caught.value)
    if isinstance(error, CorruptDataError):
        assert caught.value.path == Path("/data/train/cat/3.jpg")
    else:
        assert (caught.value.what, caught.value.fix) == ("images in /data/train/cat", "make data")


def test_messages_built_from_parts() -> None:
    assert str(CorruptDataError(Path("a.idx"), "too short", "make data")) == \
        "a.idx: too short. Fix: make data"
    assert str(DataUnavailableError("the corpus", "apt install x")) == \
        "the corpus is not available. Fix: apt install x"
