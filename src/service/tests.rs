//! The shared commands of [`DebugService`], on a host that holds only what the trait asks.

use super::*;
use std::sync::Mutex;

/// A host with nothing to step through: what the shared commands need, and a record of what
/// reached `execute` and `save`.
struct Bare {
    send: Send,
    breakpoints: Vec<Breakpoint>,
    annotations: Vec<Annotation>,
    idle: Vec<Idle>,
    executed: Vec<Command>,
    saves: Mutex<Vec<PathBuf>>,
    fail_save: bool,
}

impl DebugService for Bare {
    fn sender(&self) -> &Send {
        &self.send
    }

    fn execute(&mut self, command: Command) -> Result<()> {
        self.executed.push(command);
        Ok(())
    }

    fn breakpoints_mut(&mut self) -> &mut Vec<Breakpoint> {
        &mut self.breakpoints
    }

    fn place(&self) -> (usize, usize) {
        (2, 7)
    }

    fn annotations_mut(&mut self) -> &mut Vec<Annotation> {
        &mut self.annotations
    }

    fn op_comparisons(&self, what: &str) -> Result<Vec<OpComparison>> {
        Err(no_comparison(what, "none here"))
    }

    fn save(&self, path: &Path, _: Option<Cursor>, _: Vec<String>, _: bool) -> Result<()> {
        if self.fail_save {
            return Err(Error::invalid("disk full"));
        }
        self.saves.lock().unwrap().push(path.to_path_buf());
        Ok(())
    }

    fn idle_now(&self) -> Vec<Idle> {
        Vec::new()
    }

    fn reported_idle(&mut self) -> &mut Vec<Idle> {
        &mut self.idle
    }
}

fn bare() -> (Bare, Arc<Mutex<Vec<Update>>>) {
    let updates = Arc::new(Mutex::new(Vec::new()));
    let u = updates.clone();
    let host = Bare {
        send: Arc::new(move |update| u.lock().unwrap().push(update)),
        breakpoints: Vec::new(),
        annotations: Vec::new(),
        idle: Vec::new(),
        executed: Vec::new(),
        saves: Mutex::new(Vec::new()),
        fail_save: false,
    };
    (host, updates)
}

/// The log lines and errors sent since the last call, in order.
fn lines(updates: &Mutex<Vec<Update>>) -> Vec<String> {
    std::mem::take(&mut *updates.lock().unwrap())
        .into_iter()
        .filter_map(|u| match u {
            Update::Log(l) => Some(l),
            Update::Error(e) => Some(format!("error: {e}")),
            Update::Autosaved(Ok(p)) => Some(format!("autosaved {}", p.display())),
            Update::Autosaved(Err(e)) => Some(format!("autosave failed: {e}")),
            _ => None,
        })
        .collect()
}

#[test]
fn breakpoint_commands_are_answered_alike_by_every_host() {
    let (mut host, updates) = bare();
    let layer = Breakpoint::Layer(1);
    host.handle(Command::ToggleBreakpoint(layer.clone()));
    host.handle(Command::AddBreakpoint(Breakpoint::NanInf));
    host.handle(Command::AddBreakpoint(Breakpoint::NanInf));
    assert_eq!(host.breakpoints, [layer.clone(), Breakpoint::NanInf]);
    host.handle(Command::ToggleBreakpoint(layer.clone()));
    host.handle(Command::RemoveBreakpoint(layer));
    host.handle(Command::ClearBreakpoints);
    assert!(host.breakpoints.is_empty());
    assert_eq!(
        lines(&updates),
        [
            "breakpoint layer 1 set",
            "breakpoint nan set",
            "breakpoint nan set",
            "breakpoint layer 1 removed",
            "breakpoint layer 1 was not set",
            "1 breakpoint(s) deleted",
        ]
    );
    assert!(host.executed.is_empty(), "{:?}", host.executed);
}

#[test]
fn notes_saves_and_comparisons_are_shared_and_the_rest_goes_to_the_host() {
    let (mut host, updates) = bare();
    host.handle(Command::Note {
        text: "here".into(),
        about: None,
        pane: None,
    });
    assert_eq!(
        (host.annotations[0].run, host.annotations[0].op),
        (2, 7),
        "placed where the host is"
    );
    let save = |autosave| Command::Save {
        path: PathBuf::from("s.ron"),
        cursor: None,
        notes: Vec::new(),
        tensors: false,
        autosave,
    };
    host.handle(save(false));
    host.handle(save(true));
    host.fail_save = true;
    host.handle(save(false));
    host.handle(save(true));
    host.handle(Command::Bisect);
    host.handle(Command::Goto(Goto::FirstDivergent));
    assert_eq!(
        lines(&updates),
        [
            "saved session to s.ron",
            "autosaved s.ron",
            "error: disk full",
            "autosave failed: disk full",
            "error: bisect needs an earlier run to compare with: none here",
            "error: goto first-divergent needs an earlier run to compare with: none here",
        ]
    );
    for command in [Command::Step, Command::Goto(Goto::Op(3)), Command::Compare] {
        host.handle(command);
    }
    assert_eq!(
        host.executed,
        [Command::Step, Command::Goto(Goto::Op(3)), Command::Compare]
    );
}
