"""The `llmops` command line: run pipelines, one-off generation, model listing, policy and profiling.

Exit codes (all commands): 0 success; 1 the job ran but rows failed (unless `--allow-errors`) or the
engine/sink failed; 2 the input is invalid (bad pipeline YAML, missing file or column, bad option).
Results go to stdout, progress and diagnostics to stderr.
"""
from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import click

from llmops import __version__, core, install_hint
from llmops.cli_batch import batch_cmd
from llmops.cli_generate import generate_cmd
from llmops.cli_logs import logs_cmd
from llmops.cli_common import configure, note, want_progress
from llmops.cli_policy import policy_cmd, profile_cmd
from llmops.pipeline.load import PipelineError, load_pipeline, locate_error, parse_yaml
from llmops.pipeline.oneoff import list_all_models, models_table
from llmops.pipeline.plan import format_plan, plan_pipeline
from llmops.pipeline.runner import RunResult, run_pipeline
from llmops.pipeline.spec import Pipeline
from llmops.pipeline.sources import SourceError
from llmops.pipeline.steps import StepError
from llmops.summary import describe_failures
from llmops.templates import TemplateError

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _invalid_errors() -> tuple[type[BaseException], ...]:
    return PipelineError, SourceError, StepError, TemplateError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="llmops", message="%(prog)s %(version)s")
@click.option("--verbose", "-v", count=True, help="More log output on stderr (-v info, -vv debug).")
@click.option("--quiet", "-q", is_flag=True, help="Only errors on stderr: no progress bars, no summaries.")
def main(verbose: int, quiet: bool) -> None:
    """Run an open LLM over every row of a table.

    \b
    Examples:
      llmops run pipelines/extract_invoices.yaml --limit 5   # a YAML pipeline: source -> steps -> sink
      llmops generate "Name three colours"                   # one prompt, its answer to stdout
      llmops generate prompts.txt                            # one prompt per line, answers to stdout
      llmops batch requests.jsonl -o results.jsonl           # an OpenAI / vLLM batch file
      llmops models                                          # model names you can use
      llmops logs --since 1h --grep invoice                  # what the result cache holds: prompts, outputs
      llmops -q run pipelines/classify_tickets.yaml --limit 5 # errors only on stderr
      llmops policy --model mixtral-8x7b --gpu-memory 24GiB --cpu-memory 128GiB  # how a big model is placed
    """
    configure(verbose, quiet)


@main.command("run")
@click.argument("pipeline_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--limit", type=click.IntRange(min=0), help="Read at most N source rows (try a pipeline on a few).")
@click.option("--dry-run", is_flag=True, help="Validate and print the plan (steps, an example prompt); generate nothing.")
@click.option("--no-cache", is_flag=True, help="Neither read nor fill the result cache (everything is recomputed).")
@click.option("--runner", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where to run: this process, or a Ray cluster.")
@click.option("--address", help="With --runner ray: the Ray cluster to join (default: a running one, else a local one).")
@click.option("--num-engines", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --runner ray: engines (actors) per llm_map step.")
@click.option("--gpus-per-engine", type=click.FloatRange(min=0), default=0, show_default=True,
              help="With --runner ray: GPUs each engine actor holds (0: CPU actors).")
@click.option("--allow-errors", is_flag=True, help="Exit 0 even when some rows failed (their values are null).")
@click.option("--model", "model", help="Override the pipeline's model (and every step's) with this name or path.")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a pipeline field, e.g. --set engine.gpu_memory=24GiB --set steps.1.llm_map.max_new_tokens=8.")
@click.option("--json", "as_json", is_flag=True, help="Print the final summary (or the plan) as JSON.")
@click.option("--progress/--no-progress", default=None, help="Show a progress bar (default: when stderr is a terminal).")
@click.option("--report", "report_html", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the run report as a self-contained HTML page with plots (needs the report extra).")
def run_cmd(pipeline_file: Path, limit: int | None, dry_run: bool, no_cache: bool, runner: str, address: str | None,
            num_engines: int, gpus_per_engine: float, allow_errors: bool, model: str | None,
            overrides: tuple[str, ...], as_json: bool, progress: bool | None, report_html: Path | None) -> None:
    """Run a pipeline YAML: read the source, apply the steps, write the sink.

    Results stream to the sink as blocks finish and are published (renamed into place) when the run
    completes. Finished rows are kept in the result cache, so rerunning a killed or edited pipeline
    only computes what is missing. Exit code 1 when rows failed (see --allow-errors), 2 when the
    pipeline is invalid. The run report (figures, failures, throughput over time, where the time went,
    the policy's predicted vs measured speed and memory) is always written beside the sink as JSON;
    --report also renders it as an HTML page.

    \b
    Examples:
      llmops run pipelines/extract_invoices.yaml
      llmops run pipelines/classify_tickets.yaml --limit 20 --dry-run
      llmops run pipelines/classify_tickets.yaml --limit 20 --report out/report.html
      llmops run pipelines/extract_invoices.yaml --model /models/Mixtral-8x7B-Instruct \\
          --set engine.gpu_memory=24GiB --set engine.cpu_memory=100GiB
    """

    run_on = _ray_runner(num_engines, gpus_per_engine, address, allow_errors) if runner == "ray" \
        else functools.partial(run_pipeline, allow_errors=allow_errors)
    write_html = _html_writer() if report_html is not None and not dry_run else None
    invalid = _invalid_errors()
    try:
        pipeline = load_pipeline(pipeline_file, overrides=list(overrides) + _model_overrides(pipeline_file, model))
        _note_untuned_cpu()
        if dry_run:
            plan = plan_pipeline(pipeline, limit=limit, use_cache=not no_cache)
            click.echo(json.dumps(plan, indent=2, default=str) if as_json else format_plan(plan))
            return
        result = run_on(pipeline, limit=limit, use_cache=not no_cache, progress=want_progress(progress))
    except PipelineError as exc:
        _fail(str(exc), EXIT_INVALID)
    except invalid as exc:
        _fail(locate_error(pipeline_file, str(exc)), EXIT_INVALID)
    except Exception as exc:  # noqa: BLE001 (any engine/sink failure is reported, not a traceback)
        _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else str(result))
    if write_html is not None:
        _write_html_report(write_html, result, report_html)
    if not result.failed_rows:
        return
    if allow_errors:
        note(f"{result.failed_rows} row(s) failed (null values):")
    elif result.held:
        click.echo(f"{result.failed_rows} row(s) failed (null values), so {pipeline.sink.target} was left as it "
                   f"was; this run's rows are in {result.held} (--allow-errors publishes a run with failed rows):",
                   err=True)
    else:
        click.echo(f"{result.failed_rows} row(s) failed (null values); pass --allow-errors to exit 0:", err=True)
    for line in _failure_lines(result):
        note(line)
    if not allow_errors:
        sys.exit(EXIT_FAILED)


def _failure_lines(result: RunResult) -> list[str]:
    """Why rows failed, over the run's LLM steps (`llmops.summary.describe_failures`)."""
    by_reason: dict[str, int] = {}
    examples: list[tuple[str, str]] = []
    for step in result.llm_steps:
        for reason, n in (step.get("failed_by_reason") or {}).items():
            by_reason[reason] = by_reason.get(reason, 0) + n
        examples += [(f"steps[{step.get('step')}] row {row}", why) for row, why in step.get("failed_examples") or ()]
    return describe_failures(result.failed_rows, by_reason, examples)


def _note_untuned_cpu() -> None:
    """Once per run on a CPU: say when plans and ETAs come from the untuned default profile of this machine."""
    if core.default_device() != "cpu":
        return
    profile, _ = core.hardware_profile("local")
    if profile.source == "default":
        note(f"note: {profile.device_name} has no measured hardware profile, so plans and time estimates use "
             "untuned defaults; `llmops profile` measures this machine once (under a minute)")


def _ray_runner(num_engines: int, gpus_per_engine: float, address: str | None,
                allow_errors: bool) -> Callable[..., RunResult]:
    """`run_pipeline`'s signature, run on Ray Data (`llmops.pipeline.ray_runner`); exit 2 without Ray."""
    try:
        from llmops.pipeline.ray_runner import run_pipeline_ray  # optional dependency: the `ray` extra
        from llmops.ray import ClusterTooSmall  # optional dependency: the `ray` extra
    except ImportError as exc:
        _fail(f"--runner ray needs Ray ({exc.name or 'ray'} is not installed): {install_hint('ray')}",
              EXIT_INVALID)

    def run(pipeline: Pipeline, *, limit: int | None, use_cache: bool, progress: bool | None) -> RunResult:
        try:
            return run_pipeline_ray(pipeline, limit=limit, use_cache=use_cache, address=address,
                                    num_engines=num_engines, gpus_per_engine=gpus_per_engine,
                                    allow_errors=allow_errors)
        except ClusterTooSmall as exc:
            _fail(str(exc), EXIT_INVALID)
            raise
    return run


def _html_writer() -> Callable[[dict, Path], Path]:
    """`llmops.report_html.write_html`; exit 2 before any work when matplotlib is missing."""
    try:
        from llmops.report_html import write_html  # optional dependency: matplotlib (the `report` extra)
    except ImportError as exc:
        _fail(f"--report needs matplotlib ({exc.name or 'matplotlib'} is not installed): "
              f"{install_hint('report')}", EXIT_INVALID)
    return write_html


def _write_html_report(write_html: Callable[[dict, Path], Path], result: RunResult, target: Path) -> None:
    """Render the run's JSON report as HTML at `target`; exit 1 when either cannot be read or written."""
    if result.report is None:
        _fail(f"--report {target}: the run report JSON could not be written, so there is nothing to render",
              EXIT_FAILED)
    try:
        path = write_html(json.loads(Path(result.report).read_text()), target)
    except (OSError, ValueError) as exc:
        _fail(f"--report {target}: {exc}", EXIT_FAILED)
    note(f"report: {path}")


def _model_overrides(pipeline_file: Path, model: str | None) -> list[str]:
    """`--set` items that point the pipeline and each of its llm_map steps at `model`."""
    if model is None:
        return []

    try:
        data = parse_yaml(pipeline_file.read_text(encoding="utf-8"), filename=str(pipeline_file))
    except OSError as exc:
        raise PipelineError([f"{pipeline_file}: cannot read pipeline file: {exc.strerror}"]) from None
    value = json.dumps(model)
    items = [f"model={value}"]
    steps = data.get("steps") if isinstance(data, dict) else None
    for i, step in enumerate(steps if isinstance(steps, list) else []):
        if isinstance(step, dict) and isinstance(step.get("llm_map"), dict) and "model" in step["llm_map"]:
            items.append(f"steps.{i}.llm_map.model={value}")
    return items


@main.command("models")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list instead of a table.")
@click.option("--dir", "dirs", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="Also list local models under this folder (HF folders with config.json, .gguf files).")
def models_cmd(as_json: bool, dirs: tuple[Path, ...]) -> None:
    """List the model names `--model` and pipelines accept: local aliases (e.g. the embedded
    smollm2-135m-instruct), dummy-weight presets with their sizes (for benchmarks), and local folders.

    \b
    Examples:
      llmops models
      llmops models --dir ~/models --json
    """

    try:
        rows = list_all_models(dirs)
    except Exception as exc:  # noqa: BLE001
        _fail(f"cannot list models: {type(exc).__name__}: {exc}", EXIT_FAILED)
    click.echo(json.dumps(rows, indent=2, default=str) if as_json else models_table(rows))


main.add_command(generate_cmd, "generate")
main.add_command(batch_cmd, "batch")
main.add_command(logs_cmd, "logs")
main.add_command(policy_cmd, "policy")
main.add_command(profile_cmd, "profile")



if __name__ == "__main__":
    main()
