"""The studio's web app: FastAPI (the server library the reward server and the OpenAI endpoint
already use) with pages rendered by Jinja2, a little JavaScript of our own for live updates, and
plotly.js (served from the `plotly` package, no CDN) for the curves.

Every API request needs the token in `Authorization: Bearer <token>`; the page keeps it from the
URL the studio prints (`#token=...`, which never reaches a server) and sends it. What else a
request must be (its Host, Origin, content type, size) is guard.py's; what a body may say is
bodies.py's. The pages are shells without data: each fills itself from /api/page/<name>.
"""


import contextlib
import functools
import math
import threading
from pathlib import Path

from rft.studio import guard as G

HERE = Path(__file__).parent
PAGES = ("compose", "runs", "dashboard", "rollouts")


def plotly_js() -> Path:
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.exists():
        raise FileNotFoundError(f"{path}: the plotly package has no plotly.min.js; reinstall it (pip install -e '.[studio]')")
    return path


@functools.lru_cache(maxsize=1)
def _gzipped_plotly() -> tuple[bytes, str]:
    """plotly.min.js gzipped (once), and its ETag (the plotly version's)."""
    import gzip

    import plotly

    return gzip.compress(plotly_js().read_bytes(), 6), f'"plotly-{plotly.__version__}"'


def _number(name: str, text: str, kind: type):
    """A filter's value: None when left empty; `name` is its label on the page."""
    if not text.strip():
        return None
    try:
        value = kind(text)
        if value != value:  # nan: every comparison false, so the filter would keep every row
            raise ValueError
        return value
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not {'a number' if kind is float else 'a whole number'}; "
                         f"leave it empty for no filter.") from None


def _finite(value):
    """value with each NaN or infinity as its text ("nan", "inf", "-inf"): JSON has no such number."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_class():
    """The app's JSON answers: a NaN or infinity (a reward a run stored as NaN) is sent as its text,
    where Starlette's JSON raised (a 500 for the whole rollouts page); walked only when one is there."""
    from fastapi.responses import JSONResponse

    class FiniteJSON(JSONResponse):
        def render(self, content) -> bytes:
            try:
                return super().render(content)
            except ValueError:
                return super().render(_finite(content))

    return FiniteJSON


class Refused(Exception):
    def __init__(self, status: int, detail: str, **more):
        self.status, self.answer = status, {"detail": detail, **more}


def launch_args(conf_dir: Path, defaults: dict, body: dict, choices: dict, keys: dict,
                root: Path | None = None) -> tuple[list[str], str | None, str | None]:
    """(run.py's arguments for a launch body, composed and planned, the run directory it writes
    and the sweep directory, each under `root`, or None); Refused (400) for a mistake, a plan error
    or what the run would stop on in the directory of its name, (409) for dotted paths imported
    from outside the project that the body did not confirm (every job of a sweep composed, planned
    and checked). A sweep is given its directory (hydra.sweep.dir, as composed now): the jobs
    panel links to its jobs."""
    from rft.studio import bodies as B
    from rft.studio import compose as C
    from rft.studio import writes as W
    from rft.studio.launch import command

    sweep = bool(body.get("sweep"))
    try:
        sweep_args = B.sweep_args(body) if sweep else []
        launcher = B.launcher(body, B.launcher_options(conf_dir)) if sweep else None
        confirmed = B.confirmed(body)
        # a sweep's jobs write to the sweep's directory: the run of the name is not theirs
        comp = C.compose(conf_dir, choices, keys, defaults, existing=not sweep, root=root)
        if comp.error:  # the run would stop at the same place: say it here
            raise ValueError(comp.error)
        imports, planned = (C.check_sweep(conf_dir, comp.overrides, sweep_args, root) if sweep
                            else (comp.imports, W.refusal(root, comp.writes) if root is not None else None))
        if sweep and comp.sweep_dir and Path(comp.sweep_dir).exists():
            raise ValueError(f"{comp.sweep_dir} exists (a sweep started this second); launch again in a second.")
    except ValueError as e:
        raise Refused(400, f"not launched: {e}") from None
    unconfirmed = [i for i in imports if i["path"] not in confirmed]
    if unconfirmed:
        listed = "; ".join(f"{i['path']} ({i['key']})" for i in unconfirmed)
        raise Refused(409, f"not launched: it imports from outside rft and this repository: {listed}. Launch it "
                           f"only if you trust that code: confirm each path (confirm_imports).", imports=unconfirmed)
    writes = comp.values.get("dry_run") != "true"  # a dry run leaves no directory to link to
    outside = C.run_dir_refusal(root, comp.sweep_dir if sweep else comp.run_dir) if writes and root is not None else ""
    if outside:
        raise Refused(400, f"not launched: {outside}")
    # a job of the sweep would stop the sweep before its first job (rft.runtime.callbacks); a key
    # of the run or of a job would write outside the root (a buffer's database, the stage cache
    # typed on the page): out of the studio's sight, as a run directory there would be
    if planned:
        raise Refused(400, f"not launched: {planned}")
    args = command(comp.overrides, sweep, sweep_args, launcher)
    if sweep and comp.sweep_dir:
        args.append(f"hydra.sweep.dir={C._override_text(comp.sweep_dir)}")
    return (args, _under(root, comp.run_dir) if writes and not sweep else None,
            _under(root, comp.sweep_dir) if writes and sweep else None)


def _under(root: Path | None, path: str) -> str | None:
    """path relative to root, or None where it is not under it (or not known)."""
    if not path or root is None:
        return None
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return None


def sweep_command(conf_dir: Path, body: dict, overrides: list[str]) -> tuple[str, str]:
    """(`python run.py -m ...` as a sweep of the body would run it, "") or ("", the mistake in its values)."""
    import shlex

    from rft.studio import bodies as B
    from rft.studio.launch import command

    try:
        args = command(overrides, True, B.sweep_args(body), B.launcher(body, B.launcher_options(conf_dir)))
    except ValueError as e:
        return "", str(e)
    return "python run.py " + " ".join(shlex.quote(a) for a in args), ""


def make_app(token: str, root: Path, conf_dir: Path, repo: Path, launch_env: dict | None = None,
             hosts: frozenset[str] = G.LOOPBACK):
    """The app for checkpoint root `root`, config groups in `conf_dir`, runs launched with
    `repo`/run.py; `launch_env`: the launched runs' environment (default: the studio's); `hosts`:
    the names a request's Host may give (this machine's; guard.py)."""
    from fastapi import FastAPI

    from rft.studio import compose as C
    from rft.studio.launch import Launches

    if not token:
        raise ValueError("the studio needs a token")
    root, conf_dir, repo = Path(root), Path(conf_dir), Path(repo)
    hosts = frozenset(h.lower() for h in hosts)
    launches = Launches(repo, root / ".studio", launch_env)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # the runs table's first answer reads every run's files: read them while the page is opened
        threading.Thread(target=_warm, args=(app,), daemon=True).start()
        yield
        launches.stop_all()  # the studio stops: so do the runs it started

    app = FastAPI(title="rft studio", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan,
                  default_response_class=_json_class())
    app.state.launches = launches
    defaults = C.default_choices(conf_dir)
    # the guard is the app's middleware, so it stands before every route the groups below add
    _add_guard(app, token, hosts)
    _add_page_routes(app, root, conf_dir, defaults)
    _add_compose_routes(app, conf_dir, defaults, root)
    _add_launch_routes(app, conf_dir, defaults, launches, root)
    _add_run_routes(app, root, launches)
    _add_rollout_routes(app, root)
    return app


def _warm(app) -> None:
    try:
        app.state.runs.listing()
    except Exception:  # the page's own request says what is wrong
        pass


def _add_guard(app, token: str, hosts: frozenset[str]) -> None:
    """Every request, whatever its route (or none), passes guard.py's checks (token, Host, Origin,
    content type, size) or is refused; every answer gets its headers (CSP among them)."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse

    @app.middleware("http")
    async def guard(request: Request, call_next):
        refused = G.refusal(request.method, request.url.path, request.headers, hosts, token)
        response = PlainTextResponse(refused[1], status_code=refused[0]) if refused else await call_next(request)
        response.headers.update(G.HEADERS)
        if request.url.path.startswith("/api/"):
            response.headers["Cache-Control"] = "no-store"  # answers from the token's data stay out of caches
        return response


def _add_page_routes(app, root: Path, conf_dir: Path, defaults: dict) -> None:
    """The pages' shells, each page's part (/api/page/<name>) and the static files."""
    from fastapi import Request
    from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    from rft.studio import compose as C

    jinja = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape())
    schema = C.schema()

    def render(template: str, page: str, **data) -> str:
        return jinja.get_template(f"{template}.html").render(page=page, pages=PAGES, **data)

    @app.get("/")
    async def index():
        return RedirectResponse("/compose")

    for name in PAGES:  # each page's shell: no data, no token; its script fetches /api/page/<name>
        app.add_api_route(f"/{name}", lambda name=name: HTMLResponse(render("base", name)), methods=["GET"])

    @app.get("/api/page/{name}")
    async def page_part(name: str, run: str = ""):
        if name == "compose":
            return HTMLResponse(render("compose", name, groups=C.groups(conf_dir), defaults=defaults, schema=schema, sections=list(
                dict.fromkeys(f["key"].split(".")[0] if "." in f["key"] else "(top level)" for f in schema))))
        if name in PAGES:
            return HTMLResponse(render(name, name, root=str(root), run=run))
        return JSONResponse({"detail": f"no page {name!r}; the pages are {list(PAGES)}"}, status_code=404)

    @app.get("/static/plotly.min.js")
    async def plotly(request: Request):
        # 4.8 MB as it is, 1.4 MB gzipped; the same for the life of the installed package: cached
        body, tag = _gzipped_plotly()
        if request.headers.get("if-none-match") == tag:
            return Response(status_code=304, headers={"ETag": tag})
        headers = {"ETag": tag, "Cache-Control": "max-age=86400", "Vary": "Accept-Encoding"}
        if "gzip" in request.headers.get("accept-encoding", ""):
            return Response(body, media_type="text/javascript", headers={**headers, "Content-Encoding": "gzip"})
        return FileResponse(plotly_js(), media_type="text/javascript", headers=headers)

    @app.get("/favicon.ico")
    async def favicon():
        return FileResponse(HERE / "static" / "favicon.svg", media_type="image/svg+xml")

    @app.get("/static/{name}")
    async def static(name: str):
        kinds = {"studio.js": "text/javascript", "studio.css": "text/css", "favicon.svg": "image/svg+xml"}
        if name not in kinds:
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(HERE / "static" / name, media_type=kinds[name])


# ------------------------------------------------------------ compose and launch

async def _read(request, conf_dir: Path, defaults: dict) -> tuple[dict, dict, dict]:
    """(body, choices with the defaults filled in, keys); a 400 naming what is wrong."""
    from fastapi import HTTPException

    from rft.studio import bodies as B
    from rft.studio import compose as C

    try:
        body = B.parse(await request.body())
        options = {g: [o["name"] for o in opts] for g, opts in C.groups(conf_dir).items()}
        choices, keys = B.composition(body, options)
    except ValueError as e:
        raise HTTPException(400, str(e)) from None
    return body, {**defaults, **choices}, keys


def _add_compose_routes(app, conf_dir: Path, defaults: dict, root: Path) -> None:
    """Compose a body's choices into a config and its plan; save them as a study."""
    from fastapi import Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse

    from rft.studio import compose as C

    @app.post("/api/compose")
    async def api_compose(request: Request):
        body, choices, keys = await _read(request, conf_dir, defaults)
        sweep = bool(body.get("sweep"))
        comp = await run_in_threadpool(C.compose, conf_dir, choices, keys, defaults, True, not sweep, root)
        if sweep and not comp.error:  # the command a launch runs: -m, the values, the launcher
            comp.command, comp.error = sweep_command(conf_dir, body, comp.overrides)
        return comp.__dict__

    @app.post("/api/study")
    async def api_study(request: Request):
        body, choices, keys = await _read(request, conf_dir, defaults)
        comp = await run_in_threadpool(C.compose, conf_dir, choices, keys, defaults, False)
        if comp.error:
            return JSONResponse({"detail": f"not saved: {comp.error}"}, status_code=400)
        try:
            path = C.save_study(conf_dir, str(body.get("name", "")), comp, defaults, bool(body.get("overwrite")))
        except (ValueError, FileExistsError) as e:
            return JSONResponse({"detail": str(e)}, status_code=400)
        return {"path": str(path), "command": f"python run.py experiment={path.stem}"}


def _add_launch_routes(app, conf_dir: Path, defaults: dict, launches, root: Path) -> None:
    """Launch a body's run (or sweep), list the launches, read one's console log, stop one."""
    from fastapi import Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse

    @app.post("/api/launch")
    async def api_launch(request: Request):
        body, choices, keys = await _read(request, conf_dir, defaults)
        try:
            args, run, sweep = await run_in_threadpool(launch_args, conf_dir, defaults, body, choices, keys, root)
        except Refused as e:
            return JSONResponse(e.answer, status_code=e.status)
        return launches.start(args, run, sweep).state()

    @app.get("/api/launches")
    async def api_launches():
        return [launch.state() for launch in launches.all.values()]

    @app.get("/api/launch/{n}")
    async def api_launch_log(n: int, offset: int = 0):
        try:
            return launches.read(n, offset)
        except KeyError as e:
            return JSONResponse({"detail": str(e)}, status_code=404)
        except (ValueError, OSError) as e:  # an offset outside the log; a log deleted under the studio
            return JSONResponse({"detail": str(e)}, status_code=400)

    @app.post("/api/launch/{n}/stop")
    async def api_stop(n: int):
        try:
            return launches.stop(n)
        except KeyError as e:
            return JSONResponse({"detail": str(e)}, status_code=404)


# ------------------------------------------------------------ runs and rollouts

async def _answer(fn, *args):
    """fn(*args) on a worker thread; a path outside the root or a missing or damaged file is
    a 400 whose message the page shows."""
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse

    from rft.errors import ConfigError

    try:
        return await run_in_threadpool(fn, *args)
    except (ValueError, OSError, ConfigError) as e:
        return JSONResponse({"detail": str(e)}, status_code=400)


def _add_run_routes(app, root: Path, launches) -> None:
    """The runs under the root: their list (and as CSV), metrics, stages, curves, a sweep's table,
    two runs' config differences, a bench run's table."""
    from fastapi import Request
    from fastapi.responses import Response

    from rft.studio import runs as U

    runs = app.state.runs = U.Runs(root)

    @app.get("/api/runs")
    async def api_runs():
        return await _answer(lambda: runs.listing(launches.stopped_runs(root)))

    @app.get("/api/runs.csv")
    async def api_runs_csv():
        text = await _answer(lambda: U.csv_text(runs.listing(launches.stopped_runs(root))))
        if not isinstance(text, str):
            return text
        return Response(text, media_type="text/csv; charset=utf-8",
                        headers={"Content-Disposition": 'attachment; filename="runs.csv"'})

    @app.get("/api/metrics")
    async def api_metrics(request: Request):
        return await _answer(runs.metric_names, request.query_params.getlist("run"))

    @app.get("/api/stages")
    async def api_stages(request: Request):
        return await _answer(runs.stages, request.query_params.getlist("run"))

    @app.get("/api/curves")
    async def api_curves(request: Request, metric: str = "eval/accuracy", stage: str = ""):
        return await _answer(runs.curves, request.query_params.getlist("run"), metric, stage)

    @app.get("/api/dashboard")
    async def api_dashboard(request: Request):
        from rft.studio.dashboard import dashboard

        return await _answer(dashboard, runs, request.query_params.getlist("run"))

    @app.get("/api/sweep")
    async def api_sweep(sweep: str):
        return await _answer(runs.sweep_table, sweep)

    @app.get("/api/diff")
    async def api_diff(a: str, b: str):
        return await _answer(runs.diff, a, b)

    @app.get("/api/bench")
    async def api_bench(run: str):
        return await _answer(runs.bench, run)


def _add_rollout_routes(app, root: Path) -> None:
    """A run's stored rollouts: its sources, their rows filtered."""
    from rft.studio import rollouts as R
    from rft.studio import runs as U

    @app.get("/api/rollouts/sources")
    async def api_sources(run: str):
        return await _answer(lambda: R.sources(U.inside(root, run)))

    def _paging(limit: int, offset: int) -> None:
        if not 1 <= limit <= R.MAX_ROWS:
            raise ValueError(f"limit={limit}: give 1 to {R.MAX_ROWS} rows.")
        if offset < 0:
            raise ValueError(f"offset={offset}: give 0 or more (the first row shown, counted from 0).")

    @app.get("/api/rollouts")
    async def api_rollouts(run: str, source: str, min_reward: str = "", max_reward: str = "", step: str = "",
                           limit: int = 200, offset: int = 0, search: str = "", sort: str = ""):
        def rows():
            _paging(limit, offset)
            lo, hi = _number("reward from", min_reward, float), _number("reward to", max_reward, float)
            return R.read(U.inside(root, run), source, lo, hi, _number("version / step", step, int), limit, offset,
                          search, sort)

        return await _answer(rows)

    @app.get("/api/rollouts/groups")
    async def api_groups(run: str, source: str, step: str = "", search: str = "", sort: str = "",
                         limit: int = 5, offset: int = 0):
        from rft.studio import groups as GR

        def groups():
            _paging(limit, offset)
            return GR.read_groups(U.inside(root, run), source, _number("explore step", step, int), search, sort,
                                  offset, limit)

        return await _answer(groups)
