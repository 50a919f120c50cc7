//! The parameter lists of the kernels, as the typed launchers declare them, and a reader of the
//! `extern "C" __global__` signatures in `kernels/*.cu`: a test compares the two, so that a
//! launcher and its kernel cannot disagree on the count, order or type of the parameters.

/// The C type of a kernel parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param {
    /// `T*` of a kernel templated on the storage type: `float*` in the `_f32` kernel, `bf16_t*`
    /// in the `_bf16` one.
    Storage,
    F32Ptr,
    Bf16Ptr,
    I32Ptr,
    U8Ptr,
    U16Ptr,
    U32Ptr,
    F64Ptr,
    U64,
    U32,
    Int,
    Float,
    /// A TMA tensor map passed by value.
    Map,
    /// The statistics pass's table of tensors, passed by value (stats.cu's `StatsJobs`).
    Jobs,
}

impl Param {
    /// `Storage` made concrete for a kernel of storage type `elem`.
    pub fn resolve(self, elem: Option<super::Elem>) -> Param {
        match (self, elem) {
            (Param::Storage, Some(super::Elem::F32)) => Param::F32Ptr,
            (Param::Storage, Some(super::Elem::Bf16)) => Param::Bf16Ptr,
            (p, _) => p,
        }
    }

    /// The parameter type a C declaration such as `const float* x` or `u64 n` stands for.
    pub fn of_c(decl: &str) -> Option<Param> {
        let words: Vec<&str> = decl
            .split_whitespace()
            .filter(|w| !matches!(*w, "const" | "__grid_constant__" | "__restrict__"))
            .collect();
        let (name, ty) = words.split_last()?;
        let mut ty = ty.join(" ");
        if name.starts_with('*') {
            ty.push('*');
        }
        let ty = ty.replace(" *", "*");
        Some(match ty.as_str() {
            "float*" => Param::F32Ptr,
            "bf16_t*" => Param::Bf16Ptr,
            "int*" => Param::I32Ptr,
            "unsigned char*" | "u8*" => Param::U8Ptr,
            "unsigned short*" => Param::U16Ptr,
            "u32*" => Param::U32Ptr,
            "double*" => Param::F64Ptr,
            "u64" => Param::U64,
            "u32" => Param::U32,
            "int" => Param::Int,
            "float" => Param::Float,
            "TmaMap" => Param::Map,
            "StatsJobs" => Param::Jobs,
            _ => return None,
        })
    }
}

/// The kernels one typed launcher runs and their parameters. The pattern is a name, a name with
/// `{e}` for the storage suffix (`add_{e}`: `add_f32` and `add_bf16`), or a prefix ending in `*`.
#[derive(Debug)]
pub struct Sig {
    pub pattern: &'static str,
    pub params: &'static [Param],
}

impl Sig {
    pub const fn new(pattern: &'static str, params: &'static [Param]) -> Sig {
        Sig { pattern, params }
    }

    pub fn matches(&self, name: &str) -> bool {
        if let Some(prefix) = self.pattern.strip_suffix('*') {
            return name.starts_with(prefix);
        }
        match self.pattern.strip_suffix("{e}") {
            Some(base) => name
                .strip_prefix(base)
                .is_some_and(|suffix| suffix == "f32" || suffix == "bf16"),
            None => name == self.pattern,
        }
    }
}

/// The extern "C" kernel names defined in a source file (see [`kernel_signatures`]).
pub fn kernel_names(src: &str) -> Vec<String> {
    kernel_signatures(src).into_iter().map(|(n, _)| n).collect()
}

/// Each extern "C" kernel of a source file with its parameter declarations: declared directly,
/// or through a macro whose body declares them (`FLASH_PREFILL(name, ...)`, or names pasted
/// together from its parameters: `dequant_##name##_f32`), expanded for each use of the macro.
pub fn kernel_signatures(src: &str) -> Vec<(String, Vec<String>)> {
    /// A macro that declares kernels: its parameters and (name pattern, parameter list) of each.
    struct Macro {
        name: String,
        params: Vec<String>,
        kernels: Vec<(String, Vec<String>)>,
    }
    // Logical lines: a macro's continuation lines joined to it.
    let mut lines: Vec<String> = Vec::new();
    let mut open = false;
    for line in src.lines() {
        let continued = line.trim_end().ends_with('\\');
        let text = line.trim_end().trim_end_matches('\\').to_string();
        if open {
            let last = lines.last_mut().expect("an open line");
            last.push(' ');
            last.push_str(&text);
        } else {
            lines.push(text);
        }
        open = continued;
    }
    let mut macros: Vec<Macro> = Vec::new();
    let mut plain = String::new();
    let mut out = Vec::new();
    for line in &lines {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("#define ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let params = rest[name.len()..]
                .strip_prefix('(')
                .and_then(|p| p.split_once(')'))
                .map(|(p, _)| p.split(',').map(|s| s.trim().to_string()).collect())
                .unwrap_or_default();
            let kernels = declarations(rest);
            if !kernels.is_empty() {
                macros.push(Macro {
                    name,
                    params,
                    kernels,
                });
            }
            continue;
        }
        // A use of a declaring macro at the start of a line.
        if let Some((mac, args)) = t.split_once('(') {
            if let Some(m) = macros.iter().find(|m| m.name == mac.trim()) {
                let args: Vec<&str> = args
                    .rsplit_once(')')
                    .map_or(args, |(a, _)| a)
                    .split(',')
                    .map(str::trim)
                    .collect();
                for (pattern, decls) in &m.kernels {
                    let expanded: String = pattern
                        .split("##")
                        .map(|piece| {
                            let piece = piece.trim();
                            m.params
                                .iter()
                                .position(|p| p == piece)
                                .and_then(|i| args.get(i).copied())
                                .unwrap_or(piece)
                        })
                        .collect();
                    out.push((expanded, decls.clone()));
                }
                continue;
            }
        }
        plain.push_str(line);
        plain.push('\n');
    }
    let mut direct = declarations(&plain);
    direct.append(&mut out);
    direct
}

/// Every `extern "C" __global__ void [__launch_bounds__(..)] NAME(PARAMS)` in `text`.
fn declarations(text: &str) -> Vec<(String, Vec<String>)> {
    const HEAD: &str = "extern \"C\" __global__ void ";
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(HEAD) {
        rest = rest[at + HEAD.len()..].trim_start();
        if let Some(b) = rest.strip_prefix("__launch_bounds__") {
            rest = b.split_once(')').map_or("", |(_, r)| r).trim_start();
        }
        let Some((name, after)) = rest.split_once('(') else {
            break;
        };
        let Some((params, after)) = after.split_once(')') else {
            break;
        };
        let params = params
            .split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|p| !p.is_empty())
            .collect();
        found.push((name.trim().to_string(), params));
        rest = after;
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::device::compile::{HOPPER_SOURCES, SOURCES};
    use crate::backend::cuda::device::{
        expert_kernels, fast_kernels, fp8_kernels, kernels, merge_kernels, prefill_kernels, Elem,
    };

    #[test]
    fn kernel_names_cover_plain_bounded_and_macro_declarations() {
        let src = "extern \"C\" __global__ void plain(int a) {}\n\
                   extern \"C\" __global__ void __launch_bounds__(256, 1) bounded(int a,\n    float* b) {}\n\
                   #define MAKE(NAME, X) \\\n    extern \"C\" __global__ void NAME(int a) { body<X>(a); }\n\
                   #define OTHER(A) (A + 1)\n\
                   MAKE(made_a, 1)\nMAKE(made_b, 2)\nint y = OTHER(3);\n\
                   #define PASTE(t, B) \\\n    extern \"C\" __global__ void dq_##t##_f32(int a) {} \\\n    extern \"C\" __global__ void mm_##t(const u8* w, u64 n) {}\n\
                   PASTE(q4_k, 256)\n";
        let sigs = kernel_signatures(src);
        let names: Vec<&str> = sigs.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "plain",
                "bounded",
                "made_a",
                "made_b",
                "dq_q4_k_f32",
                "mm_q4_k"
            ]
        );
        assert_eq!(sigs[1].1, ["int a", "float* b"]);
        assert_eq!(sigs[5].1, ["const u8* w", "u64 n"]);
    }

    /// Every kernel in the sources has exactly one typed launcher's declaration, whose
    /// parameters are those of its C signature; every declaration runs some kernel.
    #[test]
    fn typed_launchers_match_the_kernel_signatures() {
        let declared: Vec<&Sig> = kernels::SIGNATURES
            .iter()
            .chain(fast_kernels::SIGNATURES.iter())
            .chain(merge_kernels::SIGNATURES.iter())
            .chain(prefill_kernels::SIGNATURES.iter())
            .chain(fp8_kernels::SIGNATURES.iter())
            .chain(expert_kernels::SIGNATURES.iter())
            .copied()
            .collect();
        let mut used = vec![0usize; declared.len()];
        let mut total = 0;
        for (file, src) in SOURCES.iter().chain(HOPPER_SOURCES.iter()) {
            for (name, decls) in kernel_signatures(src) {
                assert!(
                    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                    "{file}: kernel name {name:?}"
                );
                let owners: Vec<usize> = (0..declared.len())
                    .filter(|&i| declared[i].matches(&name))
                    .collect();
                assert_eq!(owners.len(), 1, "{file}: {name} has launchers {owners:?}");
                let sig = declared[owners[0]];
                used[owners[0]] += 1;
                let c: Vec<Option<Param>> = decls.iter().map(|d| Param::of_c(d)).collect();
                let rust: Vec<Option<Param>> = sig
                    .params
                    .iter()
                    .map(|p| Some(p.resolve(Elem::of_kernel(&name))))
                    .collect();
                assert_eq!(
                    c, rust,
                    "{file}: {name}({decls:?}) against the launcher's {:?}",
                    sig.params
                );
                total += 1;
            }
        }
        for (sig, n) in declared.iter().zip(&used) {
            assert!(*n > 0, "no kernel for the launcher of {}", sig.pattern);
        }
        assert!(total > 100, "{total} kernels");
    }

    #[test]
    fn c_declarations_read_as_parameter_types() {
        assert_eq!(Param::of_c("const float* x"), Some(Param::F32Ptr));
        assert_eq!(Param::of_c("const bf16_t *x"), Some(Param::Bf16Ptr));
        assert_eq!(
            Param::of_c("const __grid_constant__ TmaMap k_map"),
            Some(Param::Map)
        );
        assert_eq!(Param::of_c("unsigned char* mask"), Some(Param::U8Ptr));
        assert_eq!(Param::of_c("u64 n"), Some(Param::U64));
        assert_eq!(Param::of_c("int skip"), Some(Param::Int));
        assert_eq!(Param::of_c("long n"), None);
    }
}
