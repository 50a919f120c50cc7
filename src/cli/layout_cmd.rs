//! `mladb layout`: list the built-in layouts, print one as RON, or convert an HF config.json.

use super::Out;
use crate::error::Result;
use crate::model::hf_config::layout_from_config_file;
use crate::model::Layout;
use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct LayoutArgs {
    #[command(subcommand)]
    pub action: LayoutAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum LayoutAction {
    /// List the built-in layouts.
    List,
    /// Print a layout (built-in name or .ron file) as RON.
    Show { layout: String },
    /// Convert an HF config.json (glm_moe_dsa or deepseek_v3) to a layout and print it as RON.
    Import { config: PathBuf },
}

pub fn layout(args: &LayoutArgs) -> Result<()> {
    match &args.action {
        LayoutAction::List => {
            for name in Layout::builtin_names() {
                let l = Layout::resolve(name)?;
                writeln!(
                    Out,
                    "{name:<18} {:<10?} {:>3} layers, hidden {:>5}, {:.3e} parameters",
                    l.family,
                    l.num_layers,
                    l.hidden_size,
                    l.parameter_count() as f64
                )?;
            }
        }
        LayoutAction::Show { layout } => writeln!(Out, "{}", Layout::resolve(layout)?.to_ron())?,
        LayoutAction::Import { config } => {
            writeln!(Out, "{}", layout_from_config_file(config)?.to_ron())?
        }
    }
    Ok(())
}
