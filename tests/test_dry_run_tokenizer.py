"""What a dry run reads of the policy's tokenizer: its chat template, which every prompt is
rendered with, where the tokenizer is on this machine (its weights are not read)."""

import shutil

import pytest
from conftest import compose_cfg

from rft.errors import ConfigError

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture
def base_model(cache_dir, tmp_path):
    """The tiny model's config and tokenizer without its chat template (a base model's) and
    without weights: what the dry run reads is the tokenizer alone."""
    from rft.models import ensure_model

    tiny = compose_cfg(["stages=[]"]).model
    ensure_model(tiny)
    d = tmp_path / "base"
    shutil.copytree(tiny.model_path, d, ignore=shutil.ignore_patterns("*.safetensors", "manifest.json"))
    (d / "chat_template.jinja").unlink()
    assert "chat_template" not in (d / "tokenizer_config.json").read_text()
    return d


@pytest.mark.slow  # 1.0 s alone, over the fast tier's second
def test_a_dry_run_stops_on_a_base_models_missing_chat_template(base_model, tmp_path, capsys):
    """It printed the plan and exited 0; the run then stopped in its actors with this paragraph."""
    import rft.runtime.main

    args = ["stages=[]", "dry_run=true", f"model.model_path={base_model}", "model.builder=null",
            f"checkpoint_root_dir={tmp_path / 'runs'}"]
    with pytest.raises(ConfigError) as e:
        rft.runtime.main._main(compose_cfg(args))
    assert str(e.value).startswith(
        f"model.model_path='{base_model}': its tokenizer has no chat template, and every prompt is rendered with "
        f"one (a base model's tokenizer often has none). Set model.custom_chat_template to a Jinja template")
    assert "batch plan" not in capsys.readouterr().out
    # a template of the config's own: the dry run plans
    rft.runtime.main._main(compose_cfg([*args, f"model.custom_chat_template={TEMPLATE!r}"]))
    assert "batch plan" in capsys.readouterr().out
    # one that fails when rendered is said too
    with pytest.raises(ConfigError, match=r"^model.custom_chat_template fails on a one-message conversation "
                                          r"\(TemplateError: no\)"):
        rft.runtime.main._main(compose_cfg([*args, "model.custom_chat_template='{% for m in messages %}{{ raise_exception(\"no\") }}{% endfor %}'"]))


def test_a_dry_run_reads_no_tokenizer_it_would_download_or_build(cache_dir, tmp_path, capsys):
    """A hub id is not fetched by a dry run, and a model the project builds is not built by it."""
    import rft.runtime.main

    rft.runtime.main._main(compose_cfg(["stages=[]", "dry_run=true", f"model.model_path={tmp_path / 'tiny'}",
                                        f"checkpoint_root_dir={tmp_path / 'runs'}"]))
    assert "batch plan" in capsys.readouterr().out and not (tmp_path / "tiny").exists()
