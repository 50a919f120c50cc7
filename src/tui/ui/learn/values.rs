//! Live values of the Learn view: for the selected head, the query token of an absorbed phase
//! and the first cached token, q_nope, the absorbed query, one attention score computed both
//! ways, the latent output and its W_UV projection, read from the recorded outputs.

use super::num;
use crate::debug::record::RunRecord;
use crate::debug::sample::is_sampled;
use crate::engine::trace::Phase;
use crate::engine::MlaPath;
use crate::tui::app::App;
use ratatui::text::{Line, Span};

const ABSENT: &str = "not in the trace";
const SAMPLED: &str = "only a sample recorded";

/// How many values of a vector are shown.
const SHOWN: usize = 5;

/// One op's output as [tokens, values] (the whole tensor, not a sample).
struct Out<'a> {
    data: &'a [f32],
    cols: usize,
}

impl<'a> Out<'a> {
    /// Values `from..from+len` of row `r`, if the output has them.
    fn slice(&self, r: usize, from: usize, len: usize) -> Option<&'a [f32]> {
        let start = r.checked_mul(self.cols)?.checked_add(from)?;
        (from + len <= self.cols).then(|| self.data.get(start..start + len))?
    }

    fn last_row(&self) -> usize {
        (self.data.len() / self.cols.max(1)).saturating_sub(1)
    }
}

/// Looks ops up in one run, noting those recorded only as samples.
struct Finder<'a> {
    run: &'a RunRecord,
    layer: usize,
    sampled: Vec<String>,
}

impl<'a> Finder<'a> {
    /// Op `op` of the layer in `phase`, or in the first phase whose op starts at position 0;
    /// else why not.
    fn get(&mut self, op: &str, phase: Option<Phase>) -> Result<Out<'a>, &'static str> {
        self.find(op, phase).ok_or(ABSENT)?
    }

    fn find(&mut self, op: &str, phase: Option<Phase>) -> Option<Result<Out<'a>, &'static str>> {
        let name = format!("model.layers.{}.self_attn.{op}", self.layer);
        let run = self.run;
        let i = match phase {
            Some(p) => run.find(p, &name)?,
            None => run
                .events
                .iter()
                .find(|e| e.name == name && e.positions.0 == 0)
                .and_then(|e| run.find(e.phase, &name))?,
        };
        let (event, output) = (&run.events[i], &run.outputs[i]);
        if is_sampled(event, output) {
            self.sampled.push(format!("{} {op}", event.phase));
            return Some(Err(SAMPLED));
        }
        Some(Ok(Out {
            data: output.data(),
            // A row is a token: every dimension after the first.
            cols: match event.shape.as_slice() {
                [] | [_] => output.numel(),
                [_, rest @ ..] => rest.iter().product(),
            },
        }))
    }
}

pub fn lines(app: &App, layer: usize) -> Vec<Line<'static>> {
    let t = &app.theme;
    let mut out = vec![Line::from(Span::styled(
        format!("Live values, layer {layer}"),
        t.title(),
    ))];
    let (Some(run), Some(layout)) = (app.mirror.current(), app.mirror.layout()) else {
        return out;
    };
    let (p, r, v, l) = (
        layout.qk_nope_head_dim,
        layout.qk_rope_head_dim,
        layout.v_head_dim,
        layout.kv_lora_rank,
    );
    // An absorbed phase: the selected op's when it is one, else the last.
    let absorbed = |ph: Phase| run.flags.path_of(ph) == MlaPath::Absorbed;
    let q_abs = format!("model.layers.{layer}.self_attn.q_absorbed");
    let phase = app
        .selected_op()
        .map(|(_, e)| e.phase)
        .filter(|ph| absorbed(*ph) && run.find(*ph, &q_abs).is_some())
        .or_else(|| {
            let e = run.events.iter().rev().find(|e| e.name == q_abs)?;
            Some(e.phase)
        });
    let Some(phase) = phase else {
        out.push(Line::from(format!(
            "  no phase of this run ran layer {layer} on the absorbed path (prefill {} · decode {}), so there is no absorbed query to show: run a decode step with MLA on",
            path(run.flags.paths().prefill),
            path(run.flags.paths().decode),
        )));
        return out;
    };
    let mut f = Finder {
        run,
        layer,
        sampled: Vec::new(),
    };
    let q = f.get("q_b_proj", Some(phase));
    let q_pe = f.get("q_rope", Some(phase));
    let q_lat = f.get("q_absorbed", Some(phase));
    let o_lat = f.get("attn_latent", Some(phase));
    let o = f.get("attn_output", Some(phase));
    // The first cached token: its c_kv and k_pe, and k_nope where a naive phase expanded it.
    let c_kv = f.get("kv_a_layernorm", None);
    let k_pe = f.get("k_rope", None);
    let kv = f.get("kv_b_proj", None);
    let heads = q
        .as_ref()
        .map_or(layout.num_heads, |q| q.cols / (p + r))
        .max(1);
    let h = app.head % heads;
    let row = q.as_ref().map_or(0, Out::last_row);
    // The phase's last token, whether or not its values were recorded.
    let token = run
        .find(phase, &q_abs)
        .map_or(0, |i| run.events[i].positions.1.saturating_sub(1));
    out.push(Line::from(format!(
        "  head {h} (h: next head) · query token {token} of {phase} · cached token 0; first {SHOWN} values of each vector"
    )));
    let vector = |name: &str, x: Result<&[f32], &str>, width: usize| match x {
        Ok(x) => Line::from(format!("  {name:<22}[{width}] {}", show(x))),
        Err(why) => Line::from(Span::styled(
            format!("  {name:<22}[{width}] {why}"),
            t.dim(),
        )),
    };
    let qn = part(&q, Some(row), h * (p + r), p);
    let ql = part(&q_lat, None, h * l, l);
    let qp = part(&q_pe, None, h * r, r).ok();
    let ck = part(&c_kv, Some(0), 0, l).ok();
    let kp = part(&k_pe, Some(0), 0, r).ok();
    let kn = part(&kv, Some(0), h * (p + v), p).ok();
    let ol = part(&o_lat, None, h * l, l);
    let ov = part(&o, None, h * v, v);
    out.push(vector("q_nope", qn, p));
    out.push(vector("q_lat = W_UKᵀ·q_nope", ql, l));
    // One score, both ways: the nope part differs in route, the rope part is shared.
    let scale = layout.softmax_scale_from(false);
    let rope = qp.zip(kp).map(|(a, b)| dot(a, b));
    let absorbed_score = ql.ok().zip(ck).zip(rope).map(|((a, b), pe)| dot(a, b) + pe);
    let naive_score = qn.ok().zip(kn).zip(rope).map(|((a, b), pe)| dot(a, b) + pe);
    let score = |s: Option<f64>| s.map_or("—".to_string(), |s| num(s * scale));
    out.push(Line::from(format!(
        "  score[{h}, 0] absorbed (q_lat·c_kv + q_pe·k_pe)·scale = {}",
        score(absorbed_score)
    )));
    out.push(Line::from(format!(
        "  score[{h}, 0] naive  (q_nope·k_nope + q_pe·k_pe)·scale = {}{}",
        score(naive_score),
        match (absorbed_score, naive_score) {
            (Some(a), Some(b)) => format!("   |Δ| {}", num((a - b).abs() * scale)),
            (_, None) if kv.as_ref().err() == Some(&ABSENT) => {
                "   (k_nope needs a naive phase's kv_b_proj over token 0)".into()
            }
            _ => String::new(),
        }
    )));
    out.push(vector("o_lat (latent output)", ol, l));
    out.push(vector("o = W_UV·o_lat", ov, v));
    if !f.sampled.is_empty() {
        out.push(Line::from(Span::styled(
            format!(
                "  Only samples were recorded for {}: `:save --tensors FILE` records the whole tensors these values need.",
                f.sampled.join(", ")
            ),
            t.diverge(),
        )));
    }
    out
}

/// A slice of an op's token row, or why there is none.
fn part<'b>(
    x: &Result<Out<'b>, &'static str>,
    row: Option<usize>,
    from: usize,
    len: usize,
) -> Result<&'b [f32], &'static str> {
    let x = x.as_ref().map_err(|e| *e)?;
    x.slice(row.unwrap_or(x.last_row()), from, len)
        .ok_or("shape differs from the layout's")
}

fn path(p: MlaPath) -> String {
    p.to_string()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

fn show(x: &[f32]) -> String {
    let mut s: String = x
        .iter()
        .take(SHOWN)
        .map(|v| format!("{:>9}", num(*v as f64)))
        .collect();
    if x.len() > SHOWN {
        s.push_str(" …");
    }
    s
}
