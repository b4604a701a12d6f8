"""One StagePools with the real stages (pdf, ocr, asr) per session: models load once."""
from __future__ import annotations

import pytest

from foveal.stages.service import StagePools


@pytest.fixture(scope="session")
def real_stages():
    with StagePools({"pdf": 1, "ocr": 1, "asr": 1}) as stages:
        yield stages
