//! Tensor-parallel plans: which layer of a model is split how, named by module path (the style
//! of torchtitan's `parallelize_module` plans, applied when the model is built).
//!
//! A [`TpPlan`] is an ordered list of rules `pattern -> style`; the first rule whose pattern
//! matches a layer's path decides its [`TpStyle`]. Patterns are module paths as Burn reports
//! them (`blocks.0.attn.q`), with globs:
//!
//! | pattern | matches |
//! |---|---|
//! | `*` | any text inside one path segment (`ln_*` matches `ln_1`, `ln_f`) |
//! | `**` | any number of whole segments, none included |
//! | `{a,b}` | one of the alternatives (`attn.{q,k,v}`) |
//!
//! The plan is applied by the model's constructor through [`crate::init::Init`]: each layer
//! built with [`Init::linear`](crate::init::Init::linear) or
//! [`Init::embedding`](crate::init::Init::embedding) asks the plan for its style and creates only
//! this rank's shard. [`Init::finish`](crate::init::Init::finish) then fails with
//! [`TpError::Plan`] for a rule that matched no layer, so a typo in a plan is an error, not a
//! silently replicated model.
//!
//! # Example
//! ```
//! use burn_parallel::plan::{TpPlan, TpStyle};
//!
//! let plan = TpPlan::new()
//!     .colwise("blocks.*.attn.{q,k,v}")
//!     .rowwise("blocks.*.attn.o")
//!     .vocab("{wte,lm_head}")
//!     .sequence_norm("**.ln_*");
//! assert_eq!(plan.style("blocks.3.attn.k"), Some(TpStyle::Colwise));
//! assert_eq!(plan.style("blocks.3.ln_2"), Some(TpStyle::SequenceNorm));
//! assert_eq!(plan.style("ln_f"), Some(TpStyle::SequenceNorm));
//! assert_eq!(plan.style("blocks.3.mlp.up"), None); // replicated
//! ```

use std::fmt;

use crate::tensor_parallel::TpError;

/// How a layer is split over the tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TpStyle {
    /// A linear layer split by output features (Megatron's column-parallel); its output is
    /// feature-sharded and must feed a [`TpStyle::Rowwise`] layer. Under sequence parallelism
    /// its input is sequence-sharded and all-gathered first.
    Colwise,
    /// A linear layer split by input features (row-parallel); its output is all-reduced
    /// (reduce-scattered along the sequence under sequence parallelism).
    Rowwise,
    /// A vocabulary-sized layer split by vocabulary entries, padded to equal shards: an
    /// embedding (rows; output replicated) or an output head (columns; its logits go to the
    /// vocabulary-parallel cross-entropy).
    Vocab,
    /// Replicated parameters used on sequence shards under sequence parallelism (norms): their
    /// gradients are summed over the group (a no-op without sequence parallelism).
    SequenceNorm,
    /// Explicitly replicated (the default for a layer no rule matches).
    Replicate,
}

impl fmt::Display for TpStyle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            TpStyle::Colwise => "colwise",
            TpStyle::Rowwise => "rowwise",
            TpStyle::Vocab => "vocab",
            TpStyle::SequenceNorm => "sequence_norm",
            TpStyle::Replicate => "replicate",
        };
        f.write_str(name)
    }
}

/// A path pattern: segments separated by `.`, with `*`, `**` and `{a,b}` (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob {
    source: String,
    /// Every alternative of the braces, expanded, split into segments.
    alternatives: Vec<Vec<String>>,
}

impl Glob {
    /// Parses a pattern.
    ///
    /// # Errors
    /// [`TpError::Plan`] for an empty pattern or unbalanced braces.
    pub fn new(pattern: &str) -> Result<Self, TpError> {
        let bad = |why: &str| TpError::Plan(format!("pattern `{pattern}`: {why}"));
        if pattern.is_empty() {
            return Err(bad("empty"));
        }
        let expanded = expand_braces(pattern).ok_or_else(|| bad("unbalanced braces"))?;
        let alternatives = expanded
            .iter()
            .map(|p| p.split('.').map(str::to_string).collect::<Vec<_>>())
            .collect::<Vec<_>>();
        if alternatives.iter().flatten().any(String::is_empty) {
            return Err(bad(
                "empty path segment (`..`, or a leading or trailing `.`)",
            ));
        }
        Ok(Self {
            source: pattern.to_string(),
            alternatives,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Whether `path` (segments separated by `.`) matches.
    pub fn matches(&self, path: &str) -> bool {
        let segments: Vec<&str> = path.split('.').collect();
        self.alternatives
            .iter()
            .any(|pattern| match_segments(pattern, &segments))
    }
}

/// Expands `{a,b}` alternations (not nested) into every combination; `None` when unbalanced.
fn expand_braces(pattern: &str) -> Option<Vec<String>> {
    let Some(open) = pattern.find('{') else {
        return (!pattern.contains('}')).then(|| vec![pattern.to_string()]);
    };
    let close = open + pattern[open..].find('}')?;
    let (head, tail) = (&pattern[..open], &pattern[close + 1..]);
    let inner = &pattern[open + 1..close];
    if inner.contains('{') {
        return None;
    }
    let rests = expand_braces(tail)?;
    Some(
        inner
            .split(',')
            .flat_map(|alt| rests.iter().map(move |rest| format!("{head}{alt}{rest}")))
            .collect(),
    )
}

fn match_segments(pattern: &[String], path: &[&str]) -> bool {
    match pattern.split_first() {
        None => path.is_empty(),
        Some((first, rest)) if first == "**" => {
            (0..=path.len()).any(|skip| match_segments(rest, &path[skip..]))
        }
        Some((first, rest)) => match path.split_first() {
            Some((segment, path_rest)) => {
                match_segment(first, segment) && match_segments(rest, path_rest)
            }
            None => false,
        },
    }
}

/// `*` matches any run of characters inside one segment.
fn match_segment(pattern: &str, text: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == text,
        Some((prefix, rest)) => {
            let Some(text) = text.strip_prefix(prefix) else {
                return false;
            };
            (0..=text.len())
                .filter(|&i| text.is_char_boundary(i))
                .any(|i| match_segment(rest, &text[i..]))
        }
    }
}

/// One rule of a plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpRule {
    /// Which layers.
    pub glob: Glob,
    /// How they are split.
    pub style: TpStyle,
}

/// A tensor-parallel plan: rules from layer paths to [`TpStyle`]s, and the switches that apply
/// to the whole model. See the module docs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TpPlan {
    rules: Vec<TpRule>,
    errors: Vec<String>,
    /// Run the activations between the tensor-parallel regions (norms, residual adds, dropout)
    /// on each rank's part of the sequence (Korthikanti et al. 2022).
    pub sequence_parallel: bool,
    /// Each rank's vocabulary shard is a multiple of this (Megatron pads to 128).
    pub vocab_multiple: usize,
}

impl TpPlan {
    /// An empty plan: everything replicated, no sequence parallelism.
    pub fn new() -> Self {
        Self {
            rules: Vec::new(),
            errors: Vec::new(),
            sequence_parallel: false,
            vocab_multiple: 1,
        }
    }

    /// Adds a rule (earlier rules win). A malformed pattern is reported by [`Self::validate`].
    pub fn rule(mut self, pattern: &str, style: TpStyle) -> Self {
        match Glob::new(pattern) {
            Ok(glob) => self.rules.push(TpRule { glob, style }),
            Err(e) => self.errors.push(e.to_string()),
        }
        self
    }

    /// Splits the matching linear layers by output features.
    pub fn colwise(self, pattern: &str) -> Self {
        self.rule(pattern, TpStyle::Colwise)
    }

    /// Splits the matching linear layers by input features.
    pub fn rowwise(self, pattern: &str) -> Self {
        self.rule(pattern, TpStyle::Rowwise)
    }

    /// Splits the matching embeddings or output heads by vocabulary.
    pub fn vocab(self, pattern: &str) -> Self {
        self.rule(pattern, TpStyle::Vocab)
    }

    /// Marks the parameters of the matching modules as used on sequence shards (norms).
    pub fn sequence_norm(self, pattern: &str) -> Self {
        self.rule(pattern, TpStyle::SequenceNorm)
    }

    /// Keeps the matching layers replicated (to exempt them from a broader rule after it).
    pub fn replicate(self, pattern: &str) -> Self {
        self.rule(pattern, TpStyle::Replicate)
    }

    /// Turns sequence parallelism on or off.
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// Pads each vocabulary shard to a multiple of `multiple`.
    pub fn with_vocab_multiple(mut self, multiple: usize) -> Self {
        self.vocab_multiple = multiple;
        self
    }

    /// The rules, in order.
    pub fn rules(&self) -> &[TpRule] {
        &self.rules
    }

    /// The index and style of the first rule matching the layer `path`.
    pub fn lookup(&self, path: &str) -> Option<(usize, TpStyle)> {
        self.rules
            .iter()
            .position(|r| r.glob.matches(path))
            .map(|i| (i, self.rules[i].style))
    }

    /// The style of the layer `path`, `None` when no rule matches (replicated).
    pub fn style(&self, path: &str) -> Option<TpStyle> {
        self.lookup(path).map(|(_, style)| style)
    }

    /// Checks the plan itself: patterns parse, the vocabulary multiple is positive.
    ///
    /// # Errors
    /// [`TpError::Plan`] listing every problem.
    pub fn validate(&self) -> Result<(), TpError> {
        let mut errors = self.errors.clone();
        if self.vocab_multiple == 0 {
            errors.push("vocab_multiple must be at least 1".into());
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(TpError::Plan(errors.join("; ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        let g = |p: &str| Glob::new(p).unwrap();
        assert!(g("blocks.*.attn.q").matches("blocks.12.attn.q"));
        assert!(!g("blocks.*.attn.q").matches("blocks.1.2.attn.q"));
        assert!(!g("blocks.*.attn.q").matches("blocks.1.attn.qq"));
        assert!(g("**.q").matches("q"));
        assert!(g("**.q").matches("a.b.c.q"));
        assert!(g("a.**").matches("a"));
        assert!(g("a.**.z").matches("a.b.c.z"));
        assert!(g("ln_*").matches("ln_f"));
        assert!(g("*_proj").matches("q_proj"));
        assert!(!g("*_proj").matches("q_projx"));
        assert!(g("x.{q,k,v}_proj").matches("x.k_proj"));
        assert!(!g("x.{q,k,v}_proj").matches("x.o_proj"));
        assert!(g("{a,b}.{c,d}").matches("b.c"));
        assert!(Glob::new("a.{b").is_err());
        assert!(Glob::new("a..b").is_err());
        assert!(Glob::new("").is_err());
    }

    #[test]
    fn first_rule_wins_and_bad_patterns_are_reported() {
        let plan = TpPlan::new().replicate("mlp.gate").colwise("mlp.*");
        assert_eq!(plan.style("mlp.gate"), Some(TpStyle::Replicate));
        assert_eq!(plan.style("mlp.up"), Some(TpStyle::Colwise));
        assert!(plan.validate().is_ok());
        let bad = TpPlan::new().colwise("a.{b");
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("a.{b"), "{err}");
    }
}
