//! The comparison of the selected op: against the run before the last flag change (run A vs run
//! B), against the same tokens on the other MLA path (absorbed vs naive), and, for a decode op,
//! against its token's row in a whole-sequence prefill. Each section names the first divergent op.

use super::{num, short_name};
use crate::debug::compare::{prefill_vs_decode, Diff};
use crate::debug::sample::is_sampled;
use crate::debug::tolerance::Tolerances;
use crate::debug::RunRecord;
use crate::engine::trace::{OpKind, Phase};
use crate::service::AuxKind;
use crate::tui::app::{Against, App};
use crate::tui::keys::Action;
use ratatui::layout::Rect;
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use ratatui::Frame;

/// The tolerances of the selected run's dtype (the table `check` uses).
fn tolerances(app: &App) -> Tolerances {
    Tolerances::Table(
        app.mirror
            .current()
            .map_or_else(Default::default, |r| r.flags.dtype),
    )
}

/// The tolerance of an op of `kind` whose inputs agree: the least it is held to.
fn floor(app: &App, kind: OpKind) -> f64 {
    tolerances(app).row(kind).0
}

/// Figures of one op; `tolerance` is the op's judged tolerance where known, else its kind's
/// floor.
fn figures<'a>(app: &App, d: &Diff, tolerance: f64) -> Vec<Line<'a>> {
    let t = &app.theme;
    let style = if d.exceeds(tolerance) {
        t.diverge()
    } else {
        t.ok()
    };
    let mut lines = Vec::new();
    // NaN / Inf first: the figures below cover only the elements finite on both sides.
    if let Some(counts) = d.non_finite_summary() {
        lines.push(Line::from(Span::styled(format!("  {counts}"), style)));
        lines.push(Line::from(format!("  {}", d.figures_summary())));
    } else {
        lines.push(Line::from(vec![
            Span::styled(format!("  rel L2 {}", num(d.rel_l2)), style),
            Span::raw(format!(
                "  tolerance {}  cos {:.6}",
                num(tolerance),
                d.cosine
            )),
        ]));
        lines.push(Line::from(format!(
            "  max |Δ| {} at {:?}",
            num(d.max_abs),
            d.max_abs_at
        )));
    }
    if !d.per_head.is_empty() {
        let heads: Vec<String> = d
            .per_head
            .iter()
            .enumerate()
            .map(|(h, e)| format!("h{h} {}", num(*e)))
            .collect();
        lines.push(Line::from(format!("  per head: {}", heads.join("  "))));
    }
    lines
}

/// The figures of a comparison, or why there are none.
fn figures_or_why<'a>(app: &App, d: Result<Diff, String>, tolerance: f64) -> Vec<Line<'a>> {
    match d {
        Ok(d) => figures(app, &d, tolerance),
        Err(why) => vec![Line::from(Span::styled(
            format!("  {why}"),
            app.theme.dim(),
        ))],
    }
}

/// The selected op against the same op of `other`, or, with `row`, a decode op against its
/// token's row of `other`, a whole-sequence prefill. `None`: `other` has no such op.
fn op_vs(
    app: &App,
    other: &RunRecord,
    phase: Phase,
    name: &str,
    row: Option<usize>,
) -> Option<Result<Diff, String>> {
    let run = app.mirror.current()?;
    let i = run.find(phase, name)?;
    let e = &run.events[i];
    let heads = app.mirror.layout()?.num_heads;
    match row {
        None => {
            let j = other.find(phase, name)?;
            Some(super::output_diff(
                e,
                &run.outputs[i],
                &other.events[j],
                &other.outputs[j],
                heads,
            ))
        }
        Some(_) => {
            let comparisons = prefill_vs_decode(&single(run, i), other, heads, &tolerances(app));
            Some(comparisons.into_iter().next()?.diff)
        }
    }
}

/// A record holding just op `i` of `run` (to compare one decode op with a prefill row).
fn single(run: &RunRecord, i: usize) -> RunRecord {
    let mut r = RunRecord::new(run.flags);
    r.push(run.events[i].clone(), run.outputs[i].clone());
    r
}

/// The first divergent op of a whole-run comparison (computed in the update step, see
/// [`App::refresh_comparisons`]), and the judged tolerance of op `selected` in it.
fn first<'a>(
    app: &App,
    against: Against,
    label: &str,
    selected: usize,
) -> (Vec<Line<'a>>, Option<f64>) {
    let t = &app.theme;
    let Some(d) = app.divergence_cache.get(&app.divergence_key(against)) else {
        return (Vec::new(), None);
    };
    let d = d.clone();
    let tolerance = d.tolerances.get(&selected).copied();
    let first_index = d.first.as_ref().map(|f| f.0);
    let mut lines = vec![match (d.first, d.compared) {
        (Some((index, phase, name)), _) => Line::from(Span::styled(
            format!(
                "  first divergent op: #{index} {phase} {}",
                short_name(&name)
            ),
            t.diverge(),
        )),
        // Nothing compared is no agreement.
        (None, 0) => Line::from(Span::styled(
            format!("  {label}: no op could be compared"),
            t.warn(),
        )),
        (None, n) if d.alike == 0 => Line::from(Span::styled(
            format!("  {label}: all {n} ops agree within their tolerances"),
            t.ok(),
        )),
        // Agreement through the same NaN / Inf is said as such, not as plain agreement.
        (None, n) => Line::from(Span::styled(
            format!("  {label}: {n} ops agree ({} NaN/Inf alike)", d.alike),
            t.warn(),
        )),
    }];
    // A choice made otherwise before (or without) the first divergent op: what follows it may
    // differ through that choice, a flip within the scores' noise included, and not a fault.
    // (After the first divergent op a choice is expected to follow the difference.)
    if let Some((index, phase, name, rows)) = d.choice {
        if first_index.is_none_or(|f| index <= f) {
            lines.push(Line::from(Span::styled(
                format!(
                    "  choices differ at #{index} {phase} {} ({rows} row(s)): later ops may differ \
                     through that choice alone (`check` weighs a flip against the scores' noise \
                     and forces it)",
                    short_name(&name),
                ),
                t.warn(),
            )));
        }
    }
    if let Some((n, why)) = d.not_compared {
        lines.push(Line::from(Span::styled(
            format!("  {n} ops not compared: {why}"),
            t.dim(),
        )));
    }
    (lines, tolerance)
}

/// Returns how far the pane can scroll (see [`super::scrolled`]).
pub fn draw(frame: &mut Frame, app: &App, area: Rect, scroll: u16) -> u16 {
    let t = &app.theme;
    let Some((i, e)) = app.selected_op() else {
        frame.render_widget(Paragraph::new("Select an op to compare it."), area);
        return 0;
    };
    let run = app.mirror.current().expect("an op is selected");
    let mut lines = Vec::new();
    if let Some((i, _)) = app.selected_op() {
        if is_sampled(e, &run.outputs[i]) {
            lines.push(Line::from(Span::styled(
                format!(
                    "replay of sampled values: figures compare the {} values recorded of each side, where both sides have the same elements; per-head figures and token rows need the full tensors",
                    run.outputs[i].numel()
                ),
                t.dim(),
            )));
        }
    }

    // Run A vs run B.
    match (app.mirror.comparison, app.mirror.comparison_run()) {
        (Some(n), Some(other)) => {
            lines.push(Line::from(Span::styled(
                format!("vs run {n} ({})", other.flags.changes_to(&run.flags)),
                t.title(),
            )));
            let (first_line, tol) = first(app, Against::Comparison, "this run", i);
            match op_vs(app, other, e.phase, &e.name, None) {
                Some(d) => lines.extend(figures_or_why(app, d, tol.unwrap_or(floor(app, e.kind)))),
                None => lines.push(Line::from(format!(
                    "  run {n} has no such op (another path, or not reached)"
                ))),
            }
            lines.extend(first_line);
        }
        _ => lines.push(Line::from(vec![
            Span::styled("vs an earlier run: ", t.title()),
            Span::raw(format!(
                "change a flag ({} MLA disable, {} injections) to get one",
                app.keymap.key_of(Action::ToggleMla),
                app.keymap.key_of(Action::InjectMenu)
            )),
        ])),
    }

    // Absorbed vs naive, prefill vs decode.
    let (other_path, whole) = (
        app.mirror.aux(AuxKind::OtherPath),
        app.mirror.aux(AuxKind::WholePrefill),
    );
    if other_path.is_none() {
        lines.push(Line::from(vec![
            Span::styled("absorbed vs naive, prefill vs decode: ", t.title()),
            Span::raw(if run.finished() {
                format!("press {} to compute", app.keymap.key_of(Action::Compare))
            } else {
                format!(
                    "finish the run first ({} continues)",
                    app.keymap.key_of(Action::Continue)
                )
            }),
        ]));
    }
    if let Some(other) = other_path {
        let paths = (run.flags.path_of(e.phase), other.flags.path_of(e.phase));
        lines.push(Line::from(Span::styled(
            format!("{} vs {} ({})", paths.0, paths.1, e.phase),
            t.title(),
        )));
        let against = Against::Aux(AuxKind::OtherPath);
        let (first_line, tol) = first(app, against, "absorbed vs naive", i);
        match op_vs(app, other, e.phase, &e.name, None) {
            Some(d) => lines.extend(figures_or_why(app, d, tol.unwrap_or(floor(app, e.kind)))),
            None => lines.push(Line::from("  the other path has no such op")),
        }
        lines.extend(first_line);
    }
    if let Some(whole) = whole {
        lines.push(Line::from(Span::styled(
            "decode vs the same token in a whole prefill",
            t.title(),
        )));
        let against = Against::Aux(AuxKind::WholePrefill);
        let (first_line, tol) = first(app, against, "prefill vs decode", i);
        match e.phase {
            Phase::Decode(_) => match op_vs(app, whole, e.phase, &e.name, Some(e.positions.0)) {
                Some(d) => lines.extend(figures_or_why(app, d, tol.unwrap_or(floor(app, e.kind)))),
                None => lines.push(Line::from("  not comparable by token row")),
            },
            Phase::Prefill => lines.push(Line::from("  (select a decode op)")),
        }
        lines.extend(first_line);
    }
    if let Some(reference) = app.mirror.aux(AuxKind::Reference) {
        lines.push(Line::from(Span::styled(
            format!(
                "vs the reference: another engine's values ({} of its ops beside this run)",
                reference.len()
            ),
            t.title(),
        )));
        let against = Against::Aux(AuxKind::Reference);
        let (first_line, tol) = first(app, against, "the reference", i);
        match op_vs(app, reference, e.phase, &e.name, None) {
            Some(d) => lines.extend(figures_or_why(app, d, tol.unwrap_or(floor(app, e.kind)))),
            None => lines.push(Line::from("  the reference dump has no such op")),
        }
        lines.extend(first_line);
    }
    super::scrolled(frame, lines, area, scroll)
}
