"""Settings that name files are checked when they load, naming the key (not a traceback at start)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kernelmode.config import GATEWAY_CONFIG_DIR, load_settings
from kernelmode.errors import ConfigError


def test_a_gateway_config_dir_without_its_files_is_a_config_error(tmp_path: Path) -> None:
    empty = tmp_path / "gw"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"gateway\.config_dir.*lacks kernel_gateway_config\.py and kernelspec\.json"):
        load_settings(None, environ={"KERNELMODE_GATEWAY__CONFIG_DIR": str(empty)})
    with pytest.raises(ConfigError, match=r"gateway\.config_dir.*lacks"):
        load_settings(None, environ={"KERNELMODE_GATEWAY__CONFIG_DIR": str(tmp_path / "nowhere")})


def test_a_gateway_config_dir_with_both_files_loads(tmp_path: Path) -> None:
    own = tmp_path / "gw"
    own.mkdir()
    for name in ("kernel_gateway_config.py", "kernelspec.json"):
        shutil.copy(GATEWAY_CONFIG_DIR / name, own / name)
    assert load_settings(None, environ={"KERNELMODE_GATEWAY__CONFIG_DIR": str(own)}).gateway.config_dir == own


def test_an_unknown_key_names_the_nearest_key_or_its_section(tmp_path: Path) -> None:
    """A typo gets the key that was meant; a key in the wrong section gets the section where it
    belongs (a top-level `limits:` is the natural guess from the REST body)."""
    cfg = tmp_path / "kernelmode.yaml"
    cfg.write_text("limits: {memory_mb: 512}\nsessions:\n  max_sesions: 3\nsandbox:\n  backnd: bwrap\n")
    with pytest.raises(ConfigError) as e:
        load_settings(cfg, environ={})
    text = str(e.value)
    assert "sessions.max_sesions (line 3): unknown key (did you mean 'sessions.max_sessions'?)" in text
    assert "sandbox.backnd (line 5): unknown key (did you mean 'sandbox.backend'?)" in text
    assert "limits (line 1): unknown key ('limits' belongs under 'sandbox': move it to 'sandbox.limits')" in text
