//! The library's modules import downward only.
//!
//! Reads the sources of every crate under `crates/*/src` (std only, no parser dependency) and
//! builds, per crate, the graph of which file imports from which: `use crate::..`, `use
//! super::..`, `use self::..`, `use child::..` (also `pub use`), inline paths such as
//! `crate::a::b::f()` or `super::x::Y`, and inline paths through a module a `use` brought in
//! (`use crate::kernels::cube; cube::order::bind(..)`). A path resolves to the file that defines
//! its item: a module path to `a/b.rs` or `a/b/mod.rs` (or the file an inline `mod` lives in),
//! an item to the file of the module that defines it, following re-exports (`pub use`, and a
//! parent's `use` that a child reaches with `super::`) to where the item really is.
//! `#[cfg(test)]` items (the `mod tests { .. }` blocks) are left out: tests may import anything.
//!
//! Asserts:
//! 1. no circle between distinct files of one crate (prints each circle's files and the names
//!    imported along it);
//! 2. nothing under `burn-parallel/src/comm/` imports from `burn-parallel/src/kernels/`: the
//!    transports sit below the kernels.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    PathSep,
    Punct(char),
    Lit,
}

/// Rust tokens, with comments, strings and char literals dropped (a doc link is no import).
fn lex(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let n = c.len();
    let mut out = Vec::new();
    let mut i = 0;
    let ident_start = |ch: char| ch == '_' || ch.is_alphabetic();
    let ident_char = |ch: char| ch == '_' || ch.is_alphanumeric();
    // Skips a string body starting after the opening quote; returns the index after the close.
    let skip_str = |mut i: usize| {
        while i < n && c[i] != '"' {
            i += if c[i] == '\\' { 2 } else { 1 };
        }
        i + 1
    };
    while i < n {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && i + 1 < n && c[i + 1] == '/' {
            while i < n && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && i + 1 < n && c[i + 1] == '*' {
            let mut depth = 0;
            while i < n {
                if c[i] == '/' && i + 1 < n && c[i + 1] == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && i + 1 < n && c[i + 1] == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_str(i + 1);
            out.push(Tok::Lit);
        } else if ch == '\'' {
            if i + 1 < n && c[i + 1] == '\\' {
                i += 2;
                while i < n && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
                out.push(Tok::Lit);
            } else if i + 2 < n && c[i + 2] == '\'' {
                i += 3;
                out.push(Tok::Lit);
            } else {
                // A lifetime or a label.
                i += 1;
                while i < n && ident_char(c[i]) {
                    i += 1;
                }
            }
        } else if ident_start(ch) {
            let start = i;
            while i < n && ident_char(c[i]) {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            let raw_prefix = matches!(word.as_str(), "r" | "br" | "cr");
            if raw_prefix && i < n && (c[i] == '"' || c[i] == '#') {
                let mut hashes = 0;
                let mut j = i;
                while j < n && c[j] == '#' {
                    hashes += 1;
                    j += 1;
                }
                if j < n && c[j] == '"' {
                    // A raw string: ends at `"` followed by as many `#`.
                    j += 1;
                    loop {
                        if j >= n {
                            break;
                        }
                        if c[j] == '"' && (0..hashes).all(|h| j + 1 + h < n && c[j + 1 + h] == '#')
                        {
                            j += 1 + hashes;
                            break;
                        }
                        j += 1;
                    }
                    i = j;
                    out.push(Tok::Lit);
                    continue;
                }
                if word == "r" && hashes == 1 && j < n && ident_start(c[j]) {
                    // A raw identifier.
                    let s = j;
                    while j < n && ident_char(c[j]) {
                        j += 1;
                    }
                    out.push(Tok::Ident(c[s..j].iter().collect()));
                    i = j;
                    continue;
                }
            }
            if matches!(word.as_str(), "b" | "c") && i < n && c[i] == '"' {
                i = skip_str(i + 1);
                out.push(Tok::Lit);
                continue;
            }
            if word == "b" && i < n && c[i] == '\'' {
                // A byte literal: lex the char literal next round, dropping the `b`.
                continue;
            }
            out.push(Tok::Ident(word));
        } else if ch.is_ascii_digit() {
            while i < n
                && (ident_char(c[i]) || (c[i] == '.' && i + 1 < n && c[i + 1].is_ascii_digit()))
            {
                i += 1;
            }
            out.push(Tok::Lit);
        } else if ch == ':' && i + 1 < n && c[i + 1] == ':' {
            out.push(Tok::PathSep);
            i += 2;
        } else {
            out.push(Tok::Punct(ch));
            i += 1;
        }
    }
    out
}

/// A path as written at one place in one module: where it is, what it says.
#[derive(Clone, Debug)]
struct Written {
    /// The module the path is written in (absolute, from the crate root).
    module: Vec<String>,
    segs: Vec<String>,
    /// `use a::b::*`.
    glob: bool,
    /// The name it binds, for a `use` (its last segment or its `as` name).
    binds: Option<String>,
    /// A `pub use` (of any visibility): a re-export.
    reexport: bool,
}

#[derive(Default, Debug)]
struct Module {
    file: PathBuf,
    /// Items the module defines (by name); over-inclusive, which is harmless here.
    defines: HashSet<String>,
    /// Child modules declared in it (`mod x;` or `mod x { .. }`).
    children: HashSet<String>,
    /// Its `use` statements.
    uses: Vec<Written>,
    /// Its inline paths.
    inline: Vec<Written>,
}

struct Crate {
    root: PathBuf,
    modules: BTreeMap<Vec<String>, Module>,
}

fn mod_path_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut segs: Vec<String> = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let last = segs.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if !(stem == "mod" || (segs.is_empty() && stem == "lib")) {
        segs.push(stem.to_string());
    }
    segs
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// Parses a use tree, `toks[*i]` just after `use`, up to its `;`.
fn parse_use_tree(
    toks: &[Tok],
    i: &mut usize,
    prefix: Vec<String>,
    out: &mut Vec<(Vec<String>, bool, Option<String>)>,
) {
    let mut path = prefix;
    loop {
        match toks.get(*i) {
            Some(Tok::PathSep) => *i += 1,
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push((path, true, None));
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match toks.get(*i) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None => return,
                        _ => parse_use_tree(toks, i, path.clone(), out),
                    }
                }
            }
            Some(Tok::Ident(name)) => {
                *i += 1;
                if name == "self" && !path.is_empty() && toks.get(*i) != Some(&Tok::PathSep) {
                    let binds = renamed(toks, i).or_else(|| path.last().cloned());
                    out.push((path, false, binds));
                    return;
                }
                path.push(name.clone());
                if toks.get(*i) != Some(&Tok::PathSep) {
                    let binds = renamed(toks, i).or_else(|| Some(name.clone()));
                    out.push((path, false, binds));
                    return;
                }
            }
            _ => return,
        }
    }
}

/// The name of an `as name` at `toks[*i]`, stepping past it.
fn renamed(toks: &[Tok], i: &mut usize) -> Option<String> {
    match (toks.get(*i), toks.get(*i + 1)) {
        (Some(Tok::Ident(a)), Some(Tok::Ident(b))) if a == "as" => {
            *i += 2;
            Some(b.clone())
        }
        _ => None,
    }
}

/// Index just past the item that starts at `i` (up to its `;` or its closing `}`).
fn skip_item(toks: &[Tok], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < toks.len() {
        match toks[i] {
            Tok::Punct('{') | Tok::Punct('(') | Tok::Punct('[') => depth += 1,
            Tok::Punct('}') | Tok::Punct(')') | Tok::Punct(']') => {
                depth = depth.saturating_sub(1);
                if depth == 0 && toks[i] == Tok::Punct('}') {
                    return i + 1;
                }
            }
            Tok::Punct(';') if depth == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

const ITEM_KEYWORDS: &[&str] = &[
    "fn", "struct", "enum", "trait", "type", "const", "static", "union", "mod",
];

/// Reads one file's modules (the file's own and its inline ones) into `modules`.
fn read_file(file: &Path, module: Vec<String>, modules: &mut BTreeMap<Vec<String>, Module>) {
    let src = std::fs::read_to_string(file).unwrap();
    let toks = lex(&src);
    modules.entry(module.clone()).or_default().file = file.to_path_buf();
    // (module path, brace depth at which it closes)
    let mut stack: Vec<(Vec<String>, usize)> = vec![(module, 0)];
    let mut depth = 0usize;
    let mut i = 0;
    let ident = |i: usize| match toks.get(i) {
        Some(Tok::Ident(s)) => Some(s.as_str()),
        _ => None,
    };
    while i < toks.len() {
        let current = stack.last().unwrap().0.clone();
        // `#[cfg(test)]`: skip the item it guards.
        if toks[i] == Tok::Punct('#')
            && toks.get(i + 1) == Some(&Tok::Punct('['))
            && ident(i + 2) == Some("cfg")
            && toks.get(i + 3) == Some(&Tok::Punct('('))
            && ident(i + 4) == Some("test")
            && toks.get(i + 5) == Some(&Tok::Punct(')'))
            && toks.get(i + 6) == Some(&Tok::Punct(']'))
        {
            let mut j = i + 7;
            // Further attributes on the same item.
            while toks.get(j) == Some(&Tok::Punct('#')) {
                j = skip_item_brackets(&toks, j + 1);
            }
            i = skip_item(&toks, j);
            continue;
        }
        match &toks[i] {
            Tok::Punct('{') => {
                depth += 1;
                i += 1;
            }
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if stack.len() > 1 && stack.last().unwrap().1 == depth {
                    stack.pop();
                }
                i += 1;
            }
            Tok::Ident(kw) if kw == "mod" => {
                if let Some(name) = ident(i + 1) {
                    let name = name.to_string();
                    let m = modules.get_mut(&current).unwrap();
                    m.children.insert(name.clone());
                    m.defines.insert(name.clone());
                    if toks.get(i + 2) == Some(&Tok::Punct('{')) {
                        let mut inner = current.clone();
                        inner.push(name);
                        modules.entry(inner.clone()).or_default().file = file.to_path_buf();
                        stack.push((inner, depth));
                        depth += 1;
                        i += 3;
                        continue;
                    }
                }
                i += 1;
            }
            Tok::Ident(kw) if ITEM_KEYWORDS.contains(&kw.as_str()) || kw == "macro_rules" => {
                let name_at = if kw == "macro_rules" { i + 2 } else { i + 1 };
                if let Some(name) = ident(name_at) {
                    modules
                        .get_mut(&current)
                        .unwrap()
                        .defines
                        .insert(name.to_string());
                }
                i += 1;
            }
            Tok::Ident(kw) if kw == "use" && toks.get(i + 1) != Some(&Tok::Punct('<')) => {
                let reexport = is_pub(&toks, i);
                let mut j = i + 1;
                let mut leaves = Vec::new();
                parse_use_tree(&toks, &mut j, Vec::new(), &mut leaves);
                let m = modules.get_mut(&current).unwrap();
                for (segs, glob, binds) in leaves {
                    m.uses.push(Written {
                        module: current.clone(),
                        segs,
                        glob,
                        binds,
                        reexport,
                    });
                }
                while j < toks.len() && toks[j] != Tok::Punct(';') {
                    j += 1;
                }
                i = j + 1;
            }
            Tok::Ident(head)
                if toks.get(i + 1) == Some(&Tok::PathSep)
                    && !matches!(
                        toks.get(i.wrapping_sub(1)),
                        Some(Tok::PathSep) | Some(Tok::Punct('$'))
                    ) =>
            {
                // An inline path: `head::a::b`, up to its last identifier.
                let mut segs = vec![head.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::PathSep) {
                    match toks.get(j + 1) {
                        Some(Tok::Ident(s)) => {
                            segs.push(s.clone());
                            j += 2;
                        }
                        _ => break,
                    }
                }
                modules.get_mut(&current).unwrap().inline.push(Written {
                    module: current.clone(),
                    segs,
                    glob: false,
                    binds: None,
                    reexport: false,
                });
                i = j;
            }
            _ => i += 1,
        }
    }
}

/// Whether the item whose keyword is at `i` is `pub` or `pub(..)`.
fn is_pub(toks: &[Tok], i: usize) -> bool {
    let pub_at = |k: usize| toks.get(k) == Some(&Tok::Ident("pub".into()));
    match i.checked_sub(1).map(|k| &toks[k]) {
        Some(Tok::Punct(')')) => toks[..i]
            .iter()
            .rposition(|t| *t == Tok::Punct('('))
            .is_some_and(|k| k > 0 && pub_at(k - 1)),
        Some(_) => pub_at(i - 1),
        None => false,
    }
}

/// Index just past the `[ .. ]` that starts at `i`.
fn skip_item_brackets(toks: &[Tok], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < toks.len() {
        match toks[i] {
            Tok::Punct('[') => depth += 1,
            Tok::Punct(']') => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

fn read_crate(root: &Path) -> Crate {
    let src = root.join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let mut modules = BTreeMap::new();
    for file in files {
        // Binaries are crates of their own, importing the library by its name.
        if file.strip_prefix(&src).unwrap().starts_with("bin") || file.ends_with("main.rs") {
            continue;
        }
        read_file(&file, mod_path_of(&src, &file), &mut modules);
    }
    // Drop files no module declares (e.g. a test-only file behind `#[cfg(test)] mod x;`).
    let declared: Vec<Vec<String>> = modules
        .keys()
        .filter(|path| {
            path.iter().enumerate().all(|(k, name)| {
                modules
                    .get(&path[..k])
                    .is_some_and(|parent| parent.children.contains(name))
            })
        })
        .cloned()
        .collect();
    modules.retain(|path, _| declared.contains(path));
    Crate {
        root: root.to_path_buf(),
        modules,
    }
}

impl Crate {
    /// Turns a written path into an absolute one, or `None` for another crate's.
    fn absolute(&self, w: &Written) -> Option<Vec<String>> {
        let mut base = w.module.clone();
        let mut segs = w.segs.as_slice();
        match segs.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                segs = &segs[1..];
            }
            Some("self") => segs = &segs[1..],
            Some("super") => {
                while segs.first().map(String::as_str) == Some("super") {
                    base.pop()?;
                    segs = &segs[1..];
                }
            }
            Some(first) => {
                let m = self.modules.get(&base)?;
                if m.children.contains(first) {
                    // A child module, by its name.
                } else if let Some(target) = m
                    .uses
                    .iter()
                    .find(|u| {
                        u.binds.as_deref() == Some(first)
                            && u.segs.first().map(String::as_str) != Some(first)
                    })
                    .and_then(|u| self.absolute(u))
                    .filter(|t| self.modules.contains_key(t))
                {
                    // A module that a `use` brought in.
                    base = target;
                    segs = &segs[1..];
                } else {
                    return None;
                }
            }
            None => return None,
        }
        base.extend(segs.iter().cloned());
        Some(base)
    }

    /// The files an absolute path leads through: the file of the module it names or of the
    /// module defining its item, preceded by each file that re-exports it on the way (a lower
    /// file that names an item through a higher file's re-export depends on both).
    fn resolve<'a>(&'a self, path: &[String], hops: usize, out: &mut Vec<&'a Path>) {
        // The deepest module along the path.
        let mut k = path.len();
        while !self.modules.contains_key(&path[..k]) {
            k -= 1;
        }
        let module = &self.modules[&path[..k]];
        out.push(&module.file);
        if k == path.len() || hops > 16 {
            return;
        }
        let name = &path[k];
        if module.defines.contains(name) {
            return;
        }
        // Re-exported (or imported where a child reaches it): follow to its definition.
        if let Some(u) = module
            .uses
            .iter()
            .find(|u| !u.glob && u.binds.as_deref() == Some(name.as_str()))
        {
            // (`None`: another crate's item.)
            if let Some(mut target) = self.absolute(u) {
                target.extend(path[k + 1..].iter().cloned());
                self.resolve(&target, hops + 1, out);
            }
            return;
        }
        for u in module.uses.iter().filter(|u| u.glob) {
            let Some(mut target) = self.absolute(u) else {
                continue;
            };
            let names_it = self.modules.get(&target).is_some_and(|m| {
                m.defines.contains(name)
                    || m.uses
                        .iter()
                        .any(|v| v.binds.as_deref() == Some(name.as_str()))
            });
            if names_it {
                target.extend(path[k..].iter().cloned());
                return self.resolve(&target, hops + 1, out);
            }
        }
    }

    fn rel(&self, p: &Path) -> String {
        p.strip_prefix(self.root.parent().unwrap().parent().unwrap())
            .unwrap_or(p)
            .display()
            .to_string()
    }

    /// File -> file -> the names imported along that edge.
    fn graph(&self) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
        let mut g: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
        for m in self.modules.values() {
            g.entry(self.rel(&m.file)).or_default();
            for w in m.uses.iter().chain(&m.inline) {
                let Some(abs) = self.absolute(w) else {
                    continue;
                };
                // A facade: a module re-exporting what its own submodules define names it, and
                // depends on nothing. (Whoever imports through it depends on it and on the
                // definition.)
                if w.reexport && abs.starts_with(&w.module) && abs.len() > w.module.len() + 1 {
                    continue;
                }
                let mut targets = Vec::new();
                self.resolve(&abs, 0, &mut targets);
                let name = if w.glob {
                    "*".to_string()
                } else {
                    w.segs.last().cloned().unwrap_or_default()
                };
                for target in targets.into_iter().filter(|t| *t != m.file) {
                    g.entry(self.rel(&m.file))
                        .or_default()
                        .entry(self.rel(target))
                        .or_default()
                        .insert(name.clone());
                }
            }
        }
        g
    }
}

/// The strongly connected components with more than one file (Tarjan's).
fn circles(g: &BTreeMap<String, BTreeMap<String, BTreeSet<String>>>) -> Vec<Vec<String>> {
    struct State<'a> {
        g: &'a BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
        index: HashMap<&'a str, usize>,
        low: HashMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: HashSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.g.get(v).into_iter().flat_map(|e| e.keys()) {
            if !s.index.contains_key(w.as_str()) {
                visit(s, w);
                let lw = s.low[w.as_str()];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w.as_str()) {
                let iw = s.index[w.as_str()];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack.remove(w);
                scc.push(w.to_string());
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                s.out.push(scc);
            }
        }
    }
    let mut s = State {
        g,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on_stack: HashSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// One shortest circle through `start` inside `scc`, as its files in order.
fn one_circle(
    g: &BTreeMap<String, BTreeMap<String, BTreeSet<String>>>,
    scc: &[String],
    start: &str,
) -> Vec<String> {
    let inside: HashSet<&str> = scc.iter().map(String::as_str).collect();
    let mut prev: HashMap<&str, &str> = HashMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for w in g[v]
            .keys()
            .map(String::as_str)
            .filter(|w| inside.contains(w))
        {
            if w == start {
                let mut path = vec![v.to_string()];
                let mut at = v;
                while at != start {
                    at = prev[at];
                    path.push(at.to_string());
                }
                path.reverse();
                return path;
            }
            if !prev.contains_key(w) {
                prev.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    unreachable!("a strongly connected component has a circle through each of its files")
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn crates() -> Vec<Crate> {
    let mut roots: Vec<PathBuf> = std::fs::read_dir(workspace().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("src").is_dir())
        .collect();
    roots.sort();
    roots.iter().map(|r| read_crate(r)).collect()
}

#[test]
fn no_import_circle_between_files() {
    let mut report = String::new();
    let mut files = 0;
    for krate in crates() {
        let g = krate.graph();
        files += g.len();
        for scc in circles(&g) {
            writeln!(
                report,
                "circle among {} files of {}:",
                scc.len(),
                krate.rel(&krate.root)
            )
            .unwrap();
            for f in &scc {
                writeln!(report, "    {f}").unwrap();
            }
            // Every file of the component is on some circle; show one through each until all
            // are covered.
            let mut shown: HashSet<String> = HashSet::new();
            for start in &scc {
                if shown.contains(start) {
                    continue;
                }
                let path = one_circle(&g, &scc, start);
                writeln!(report, "  for example:").unwrap();
                for (k, from) in path.iter().enumerate() {
                    let to = &path[(k + 1) % path.len()];
                    let names: Vec<&str> = g[from][to].iter().map(String::as_str).collect();
                    writeln!(report, "    {from} -> {to}  ({})", names.join(", ")).unwrap();
                    shown.insert(from.clone());
                }
            }
        }
    }
    assert!(
        files > 50,
        "read only {files} files: is the workspace layout still crates/*/src?"
    );
    assert!(
        report.is_empty(),
        "modules must import downward only; import circles:\n{report}"
    );
}

#[test]
fn comm_does_not_import_the_kernels() {
    let krate = crates()
        .into_iter()
        .find(|c| c.root.ends_with("burn-parallel"))
        .unwrap();
    let g = krate.graph();
    let comm = "crates/burn-parallel/src/comm/";
    let kernels = "crates/burn-parallel/src/kernels/";
    assert!(g.keys().any(|f| f.starts_with(comm)) && g.keys().any(|f| f.starts_with(kernels)));
    let mut report = String::new();
    for (from, edges) in g.iter().filter(|(f, _)| f.starts_with(comm)) {
        for (to, names) in edges.iter().filter(|(t, _)| t.starts_with(kernels)) {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            writeln!(report, "    {from} -> {to}  ({})", names.join(", ")).unwrap();
        }
    }
    assert!(
        report.is_empty(),
        "the transports (comm/) must not import the kernels:\n{report}"
    );
}

/// The reader itself, on small sources: what counts as an import and where it resolves.
#[test]
fn the_reader_sees_imports_and_skips_tests_and_comments() {
    let toks = lex(
        "use crate::a::{b::{C, d as e}, self}; // crate::x::y\n\"crate::s::t\" 'a' r#\"crate::r\"#",
    );
    let mut i = 1;
    let mut leaves = Vec::new();
    parse_use_tree(&toks, &mut i, Vec::new(), &mut leaves);
    let leaves: Vec<(String, Option<String>)> = leaves
        .into_iter()
        .map(|(p, _, b)| (p.join("::"), b))
        .collect();
    assert_eq!(
        leaves,
        vec![
            ("crate::a::b::C".to_string(), Some("C".to_string())),
            ("crate::a::b::d".to_string(), Some("e".to_string())),
            ("crate::a".to_string(), Some("a".to_string())),
        ]
    );
    // Comments and strings are no paths.
    assert_eq!(
        toks.iter()
            .filter(|t| **t == Tok::Ident("x".into()))
            .count(),
        0
    );
    assert_eq!(
        toks.iter()
            .filter(|t| **t == Tok::Ident("r".into()))
            .count(),
        0
    );
}
