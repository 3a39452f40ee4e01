"""The studio's web app: FastAPI (the server library the reward server and the OpenAI endpoint
already use) with pages rendered by Jinja2, a little JavaScript of our own for live updates, and
plotly.js (served from the `plotly` package, no CDN) for the curves.

Every request needs the token: `?token=` in the URL the studio prints (which also sets a cookie,
so the page's own requests carry it), the cookie, or `Authorization: Bearer <token>`.
"""


import contextlib
import secrets
from pathlib import Path

HERE = Path(__file__).parent
COOKIE = "rft_studio_token"
PAGES = ("compose", "runs", "rollouts")


def plotly_js() -> Path:
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.exists():
        raise FileNotFoundError(f"{path}: the plotly package has no plotly.min.js; reinstall it (pip install -e '.[studio]')")
    return path


def make_app(token: str, root: Path, conf_dir: Path, repo: Path, launch_env: dict | None = None):
    """The app for checkpoint root `root`, config groups in `conf_dir`, runs launched with
    `repo`/run.py; `launch_env`: the launched runs' environment (default: the studio's)."""
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    from rft.errors import ConfigError
    from rft.studio import compose as C
    from rft.studio import rollouts as R
    from rft.studio import runs as U
    from rft.studio.launch import Launches, command

    if not token:
        raise ValueError("the studio needs a token")
    expected = token.encode()
    root, conf_dir, repo = Path(root), Path(conf_dir), Path(repo)
    launches = Launches(repo, root / ".studio", launch_env)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        launches.stop_all()  # the studio stops: so do the runs it started

    app = FastAPI(title="rft studio", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    jinja = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape())
    app.state.launches = launches
    defaults = C.default_choices(conf_dir)
    schema = C.schema()

    def allowed(request: Request) -> bool:
        given = [request.query_params.get("token"), request.cookies.get(COOKIE)]
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given.append(bearer.strip())
        return any(g and secrets.compare_digest(g.encode(), expected) for g in given)

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if not allowed(request):
            return PlainTextResponse(
                "refused: the rft studio needs its token. Open the URL `python -m rft.studio` printed "
                "(http://...?token=...), or send 'Authorization: Bearer <token>'.", status_code=401)
        response = await call_next(request)
        if request.query_params.get("token"):  # the page's own requests carry it from now on
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    def page(name: str, **data) -> HTMLResponse:
        return HTMLResponse(jinja.get_template(f"{name}.html").render(page=name, pages=PAGES, **data))

    @app.get("/")
    async def index():
        return RedirectResponse("/compose")

    @app.get("/compose")
    async def compose_page():
        return page("compose", groups=C.groups(conf_dir), defaults=defaults, schema=schema,
                    sections=list(dict.fromkeys(f["key"].split(".")[0] if "." in f["key"] else "(top level)" for f in schema)))

    @app.get("/runs")
    async def runs_page():
        return page("runs", root=str(root))

    @app.get("/rollouts")
    async def rollouts_page(run: str = ""):
        return page("rollouts", root=str(root), run=run)

    @app.get("/static/plotly.min.js")
    async def plotly():
        return FileResponse(plotly_js(), media_type="text/javascript")

    @app.get("/static/{name}")
    async def static(name: str):
        path = HERE / "static" / name
        if name not in ("studio.js", "studio.css"):
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(path, media_type="text/javascript" if name.endswith(".js") else "text/css")

    # ------------------------------------------------------------ compose and launch

    def body_choices(body: dict) -> tuple[dict, dict]:
        choices = {g: str(o) for g, o in (body.get("choices") or {}).items() if g in defaults}
        keys = {str(k): str(v) for k, v in (body.get("keys") or {}).items()}
        return {**defaults, **choices}, keys

    @app.post("/api/compose")
    async def api_compose(request: Request):
        choices, keys = body_choices(await request.json())
        comp = await run_in_threadpool(C.compose, conf_dir, choices, keys, defaults)
        return comp.__dict__

    @app.post("/api/study")
    async def api_study(request: Request):
        body = await request.json()
        choices, keys = body_choices(body)
        comp = await run_in_threadpool(C.compose, conf_dir, choices, keys, defaults, False)
        if comp.error:
            return JSONResponse({"detail": f"not saved: {comp.error}"}, status_code=400)
        try:
            path = C.save_study(conf_dir, str(body.get("name", "")), comp, defaults, bool(body.get("overwrite")))
        except (ValueError, FileExistsError) as e:
            return JSONResponse({"detail": str(e)}, status_code=400)
        return {"path": str(path), "command": f"python run.py experiment={path.stem}"}

    @app.post("/api/launch")
    async def api_launch(request: Request):
        body = await request.json()
        choices, keys = body_choices(body)
        comp = await run_in_threadpool(C.compose, conf_dir, choices, keys, defaults)
        if comp.error:  # the run would stop at the same place: say it here
            return JSONResponse({"detail": f"not launched: {comp.error}"}, status_code=400)
        args = command(comp.overrides, bool(body.get("sweep")), str(body.get("sweep_params") or ""),
                       body.get("launcher") or None)
        return launches.start(args).state()

    @app.get("/api/launches")
    async def api_launches():
        return [launch.state() for launch in launches.all.values()]

    @app.get("/api/launch/{n}")
    async def api_launch_log(n: int, offset: int = 0):
        try:
            return launches.read(n, offset)
        except KeyError as e:
            return JSONResponse({"detail": str(e)}, status_code=404)

    @app.post("/api/launch/{n}/stop")
    async def api_stop(n: int):
        try:
            return launches.stop(n)
        except KeyError as e:
            return JSONResponse({"detail": str(e)}, status_code=404)

    # ------------------------------------------------------------ runs and rollouts

    async def answer(fn, *args):
        """fn(*args) on a worker thread; a path outside the root or a missing or damaged file is
        a 400 whose message the page shows."""
        try:
            return await run_in_threadpool(fn, *args)
        except (ValueError, OSError, ConfigError) as e:
            return JSONResponse({"detail": str(e)}, status_code=400)

    @app.get("/api/runs")
    async def api_runs():
        return await answer(U.listing, root)

    @app.get("/api/metrics")
    async def api_metrics(request: Request):
        return await answer(U.metric_names, root, request.query_params.getlist("run"))

    @app.get("/api/stages")
    async def api_stages(request: Request):
        return await answer(U.stages, root, request.query_params.getlist("run"))

    @app.get("/api/curves")
    async def api_curves(request: Request, metric: str = "eval/accuracy", stage: str = ""):
        return await answer(U.curves, root, request.query_params.getlist("run"), metric, stage)

    @app.get("/api/sweep")
    async def api_sweep(sweep: str):
        return await answer(U.sweep_table, root, sweep)

    @app.get("/api/rollouts/sources")
    async def api_sources(run: str):
        return await answer(lambda: R.sources(U.inside(root, run)))

    @app.get("/api/rollouts")
    async def api_rollouts(run: str, source: str, min_reward: str = "", max_reward: str = "", step: str = "",
                           limit: int = 200):
        def read():
            lo = float(min_reward) if min_reward.strip() else None
            hi = float(max_reward) if max_reward.strip() else None
            at = int(step) if step.strip() else None
            return R.read(U.inside(root, run), source, lo, hi, at, limit)

        return await answer(read)

    return app
