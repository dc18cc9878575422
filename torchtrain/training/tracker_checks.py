"""Whether each tracker of `logging.report_to` can start, checked before any work (prepare_run, before the run
folder is touched), and the clients torchtrain.training.trackers opens them with.

    check_trackers(cfg)   each named tracker's package installed, the W&B project name one W&B takes and a W&B
                          login when W&B is online, MLflow's tracking store answering within PROBE_TIMEOUT_S; else
                          one line (exit 2)
"""

from __future__ import annotations

import contextlib
import netrc
import os
from typing import Any, Iterator
from urllib.parse import urlparse

from anchor_core.errors import InputError
from anchor_core.extras import missing_extra
from torchtrain.config import TrainConfig

# How long check_trackers waits for MLflow's tracking server: one try (MLflow's own default retries for about
# four minutes, which a run's start should not wait for on a server that is gone).
PROBE_TIMEOUT_S = 5


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def check_trackers(cfg: TrainConfig) -> None:
    """Each tracker of logging.report_to installed and able to start (module docstring); one line otherwise."""
    where = cfg.where("logging.report_to")
    for name in cfg.logging.report_to:
        try:
            __import__(name)  # each tracker's package is named as the tracker
        except ModuleNotFoundError as e:
            raise InputError(missing_extra(e, f"logging.report_to {name}") or one_line(e), path=where) from None
    if "wandb" in cfg.logging.report_to:
        _check_wandb(cfg)
    if "mlflow" in cfg.logging.report_to:
        mlflow_client(where)


# ---------------------------------------------------------------------------------------------------------------
# W&B before any work: the project name, and a login where it logs online

def _check_wandb(cfg: TrainConfig) -> None:
    import wandb

    try:  # W&B's own rule (a project name's length and characters)
        wandb.Settings(project=cfg.logging.project)
    except Exception as e:  # noqa: BLE001 -- whatever W&B refuses it with is the one line
        raise InputError(f"logging.project: W&B refuses it as a project name ({one_line(e)}); choose another",
                         path=cfg.where("logging.project")) from None
    settings = wandb_settings()
    if settings.mode in ("offline", "dryrun", "disabled") or _wandb_logged_in(settings):
        return
    host = urlparse(settings.base_url).hostname or settings.base_url
    raise InputError(f"logging.report_to wandb: W&B logs online (WANDB_MODE is {settings.mode!r}) and finds no login "
                     f"for {host} (no WANDB_API_KEY, no entry in ~/.netrc); run `wandb login`, or set "
                     "WANDB_MODE=offline to keep the run in files that `wandb sync` uploads later",
                     path=cfg.where("logging.report_to"))


def wandb_settings() -> Any:
    """W&B's settings as `wandb.init` would resolve them here: its settings files, then its environment variables."""
    from wandb.sdk.wandb_settings import Settings

    settings = Settings()
    if hasattr(settings, "update_from_system_settings"):
        settings.update_from_system_settings()
    settings.update_from_env_vars(dict(os.environ))
    return settings


def _wandb_logged_in(settings: Any) -> bool:
    """An API key where W&B looks for one: WANDB_API_KEY, an identity token file, its settings, or ~/.netrc's entry
    for its host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or \
            getattr(settings, "api_key", None) or getattr(settings, "identity_token_file", None):
        return True
    host = urlparse(settings.base_url).hostname or settings.base_url
    for path in filter(None, [os.environ.get("NETRC"), "~/.netrc", "~/_netrc"]):
        try:
            auth = netrc.netrc(os.path.expanduser(path)).authenticators(host)
        except (OSError, netrc.NetrcParseError):
            continue
        if auth and auth[2]:
            return True
    return False


# ---------------------------------------------------------------------------------------------------------------
# MLflow: its store, probed within a bound

@contextlib.contextmanager
def _bounded_http() -> Iterator[None]:
    """MLflow's HTTP calls made within: one try of at most PROBE_TIMEOUT_S seconds (the user's own, when shorter);
    MLflow reads these variables at each call."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
    try:
        timeout = min(PROBE_TIMEOUT_S, int(saved["MLFLOW_HTTP_REQUEST_TIMEOUT"] or PROBE_TIMEOUT_S))
    except ValueError:
        timeout = PROBE_TIMEOUT_S
    os.environ.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT=str(max(1, timeout)))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mlflow_client(where: str) -> Any:
    """A client of MLflow's tracking store (MLFLOW_TRACKING_URI, else MLflow's default), probed within the bound."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = mlflow.get_tracking_uri()
    if uri.startswith("sqlite:"):  # mlflow-skinny's SQL store needs SQLAlchemy and Alembic (the trackers extra)
        for module in ("sqlalchemy", "alembic"):
            try:
                __import__(module)
            except ModuleNotFoundError as e:
                raise InputError(missing_extra(e, f"logging.report_to mlflow with the store {uri}") or one_line(e),
                                 path=where) from None
    try:
        with _bounded_http():
            client = MlflowClient(tracking_uri=uri)
            client.search_experiments(max_results=1)
    except Exception as e:  # noqa: BLE001 -- any failure of the store is the one line
        raise InputError(f"logging.report_to mlflow: the tracking store {uri} does not answer within "
                         f"{PROBE_TIMEOUT_S} s ({one_line(e)}); start it, or set MLFLOW_TRACKING_URI to one that "
                         "answers (a tracking server http://..., or sqlite:///PATH.db)", path=where) from None
    return client
