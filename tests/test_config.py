import pytest

from monarch_cli import configure
from monarch_cli.config import settings


def test_configure_changes_and_validates_settings():
    old = settings().call_timeout
    try:
        assert configure(call_timeout=3.5).call_timeout == 3.5
    finally:
        configure(call_timeout=old)
    with pytest.raises(TypeError, match="unknown setting"):
        configure(no_such_thing=1)
    with pytest.raises(ValueError, match="transport"):
        configure(transport="carrier-pigeon")
