//! A reader of the pickles `torch.save` writes (protocol 2, and the protocol 4 opcodes newer
//! Pythons use): enough of Python's pickle machine to rebuild dicts, lists, tuples, numbers and
//! strings, with calls (`REDUCE`), globals and persistent ids kept as data for the caller to
//! interpret. Nothing is ever executed. Hostile input gets an error, never a panic or an
//! unbounded allocation: every value counts against a node budget, strings against the input's
//! own length.

/// A value of the pickle, calls and globals left as data.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    /// Key-value pairs in insertion order (a `dict` or an `OrderedDict`).
    Dict(Vec<(Value, Value)>),
    /// `module.name`, unresolved.
    Global(String, String),
    /// `func(*args)`, not called; `state` is what a `BUILD` gave it.
    Call {
        func: Box<Value>,
        args: Box<Value>,
        state: Option<Box<Value>>,
    },
    /// What `persistent_load` would have been given (torch: a storage's description).
    Persistent(Box<Value>),
}

impl Value {
    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }

    /// A tuple's or a list's items.
    pub fn items(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(v) | Value::List(v) => Some(v),
            _ => None,
        }
    }

    /// The value under a string key of a dict.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(pairs) => pairs
                .iter()
                .find(|(k, _)| k.as_str() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }
}

/// Values a pickle may build in all (copies from the memo included).
const MAX_NODES: usize = 4_000_000;
/// How deep containers may nest (torch's pickles nest a few levels; a deeper one would make
/// dropping the value recurse without bound).
const MAX_DEPTH: usize = 64;

/// A value with what it costs: the values it holds (itself included) and how deep it nests.
#[derive(Clone)]
struct Item {
    v: Value,
    nodes: usize,
    depth: usize,
}

impl Item {
    fn leaf(v: Value) -> Item {
        Item {
            v,
            nodes: 1,
            depth: 1,
        }
    }

    /// A value made of `parts`.
    fn of(parts: Vec<Item>, make: impl FnOnce(Vec<Value>) -> Value) -> Item {
        let nodes = 1 + parts.iter().map(|p| p.nodes).sum::<usize>();
        let depth = 1 + parts.iter().map(|p| p.depth).max().unwrap_or(0);
        Item {
            v: make(parts.into_iter().map(|p| p.v).collect()),
            nodes,
            depth,
        }
    }

    /// Adds `parts` to this container's cost.
    fn grow(&mut self, parts: &[Item]) {
        self.nodes += parts.iter().map(|p| p.nodes).sum::<usize>();
        self.depth = self
            .depth
            .max(1 + parts.iter().map(|p| p.depth).max().unwrap_or(0));
    }
}

enum Slot {
    Mark,
    Value(Item),
}

/// Reads one pickle; the error says what was wrong and at which byte.
pub fn read(bytes: &[u8]) -> Result<Value, String> {
    Machine {
        bytes,
        at: 0,
        stack: Vec::new(),
        memo: std::collections::HashMap::new(),
        nodes: 0,
    }
    .run()
}

struct Machine<'a> {
    bytes: &'a [u8],
    at: usize,
    stack: Vec<Slot>,
    memo: std::collections::HashMap<u32, Item>,
    /// Values built so far: the budget against [`MAX_NODES`].
    nodes: usize,
}

impl Machine<'_> {
    fn run(&mut self) -> Result<Value, String> {
        loop {
            let op_at = self.at;
            let op = self.take(1)?[0];
            self.op(op)
                .map_err(|e| format!("pickle opcode {op:#04x} at byte {op_at}: {e}"))?;
            if op == b'.' {
                return match (self.stack.pop(), self.stack.is_empty()) {
                    (Some(Slot::Value(item)), true) => Ok(item.v),
                    _ => Err("the pickle ends with other than one value on its stack".into()),
                };
            }
        }
    }

    fn op(&mut self, op: u8) -> Result<(), String> {
        match op {
            0x80 => drop(self.take(1)?), // PROTO
            0x95 => drop(self.take(8)?), // FRAME: a length hint only
            b'.' => {}                   // STOP
            b'(' => self.stack.push(Slot::Mark),
            b'N' => self.leaf(Value::None)?,
            0x88 => self.leaf(Value::Bool(true))?,
            0x89 => self.leaf(Value::Bool(false))?,
            b'}' => self.leaf(Value::Dict(Vec::new()))?,
            b']' => self.leaf(Value::List(Vec::new()))?,
            b')' => self.leaf(Value::Tuple(Vec::new()))?,
            b'J' => {
                let v = i32::from_le_bytes(self.array()?);
                self.leaf(Value::Int(v as i64))?
            }
            b'K' => {
                let v = self.take(1)?[0];
                self.leaf(Value::Int(v as i64))?
            }
            b'M' => {
                let v = u16::from_le_bytes(self.array()?);
                self.leaf(Value::Int(v as i64))?
            }
            0x8a | 0x8b => {
                let n = if op == 0x8a {
                    self.take(1)?[0] as usize
                } else {
                    u32::from_le_bytes(self.array()?) as usize
                };
                let v = long(self.take(n)?)?;
                self.leaf(Value::Int(v))?
            }
            b'G' => {
                let v = f64::from_be_bytes(self.array()?);
                self.leaf(Value::Float(v))?
            }
            b'X' | 0x8c | 0x8d | b'T' | b'U' => {
                let n = match op {
                    0x8c | b'U' => self.take(1)?[0] as usize,
                    0x8d => usize::try_from(u64::from_le_bytes(self.array()?))
                        .map_err(|_| "a string longer than memory")?,
                    _ => u32::from_le_bytes(self.array()?) as usize,
                };
                let s = String::from_utf8_lossy(self.take(n)?).into_owned();
                self.leaf(Value::Str(s))?
            }
            b'B' | b'C' | 0x8e => {
                let n = match op {
                    b'C' => self.take(1)?[0] as usize,
                    0x8e => usize::try_from(u64::from_le_bytes(self.array()?))
                        .map_err(|_| "bytes longer than memory")?,
                    _ => u32::from_le_bytes(self.array()?) as usize,
                };
                let raw = self.take(n)?.to_vec();
                self.leaf(Value::Bytes(raw))?
            }
            b'c' => {
                let module = self.line()?;
                let name = self.line()?;
                self.leaf(Value::Global(module, name))?
            }
            0x93 => {
                let name = self.pop()?;
                let module = self.pop()?;
                match (module.v, name.v) {
                    (Value::Str(m), Value::Str(n)) => self.leaf(Value::Global(m, n))?,
                    _ => return Err("STACK_GLOBAL of other than two strings".into()),
                }
            }
            b'Q' => {
                let id = self.pop()?;
                let item = Item::of(vec![id], |mut v| Value::Persistent(Box::new(v.remove(0))));
                self.push(item)?
            }
            b't' | b'l' => {
                let items = self.pop_to_mark()?;
                let item = Item::of(items, |v| {
                    if op == b't' {
                        Value::Tuple(v)
                    } else {
                        Value::List(v)
                    }
                });
                self.push(item)?
            }
            b'd' => {
                let items = self.pop_to_mark()?;
                let mut bad = None;
                let item = Item::of(items, |v| match pairs(v) {
                    Ok(p) => Value::Dict(p),
                    Err(e) => {
                        bad = Some(e);
                        Value::None
                    }
                });
                if let Some(e) = bad {
                    return Err(e);
                }
                self.push(item)?
            }
            0x85..=0x87 => {
                let n = (op - 0x84) as usize;
                let mut items = (0..n).map(|_| self.pop()).collect::<Result<Vec<_>, _>>()?;
                items.reverse();
                self.push(Item::of(items, Value::Tuple))?
            }
            b'q' => {
                let k = self.take(1)?[0] as u32;
                self.put(k)?
            }
            b'r' => {
                let k = u32::from_le_bytes(self.array()?);
                self.put(k)?
            }
            0x94 => {
                let k = self.memo.len() as u32;
                self.put(k)?
            }
            b'h' | b'j' => {
                let k = if op == b'h' {
                    self.take(1)?[0] as u32
                } else {
                    u32::from_le_bytes(self.array()?)
                };
                let item = self
                    .memo
                    .get(&k)
                    .ok_or_else(|| format!("memo entry {k} was never put"))?
                    .clone();
                // The copy counts in full: a memo entry copied again and again is what a
                // pickle bomb is made of.
                self.charge(item.nodes)?;
                self.stack.push(Slot::Value(item));
            }
            b'R' | 0x81 => {
                let args = self.pop()?;
                let func = self.pop()?;
                let item = match &func.v {
                    Value::Global(m, n) if m == "collections" && n == "OrderedDict" => {
                        Item::leaf(Value::Dict(Vec::new()))
                    }
                    _ => Item::of(vec![func, args], |mut v| {
                        let args = v.pop().expect("two parts");
                        let func = v.pop().expect("two parts");
                        Value::Call {
                            func: Box::new(func),
                            args: Box::new(args),
                            state: None,
                        }
                    }),
                };
                self.push(item)?
            }
            b'b' => {
                let state = self.pop()?;
                let top = self.top()?;
                // A dict's state (an OrderedDict's attributes) says nothing mladb reads.
                if matches!(top.v, Value::Call { .. }) {
                    top.grow(std::slice::from_ref(&state));
                    if let Value::Call { state: s, .. } = &mut top.v {
                        *s = Some(Box::new(state.v));
                    }
                }
                self.check(self.top_item()?)?;
            }
            b's' | b'u' => {
                let items = if op == b's' {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    vec![k, v]
                } else {
                    self.pop_to_mark()?
                };
                let top = self.top()?;
                top.grow(&items);
                let new = pairs(items.into_iter().map(|i| i.v).collect())?;
                match &mut top.v {
                    Value::Dict(p) => p.extend(new),
                    _ => return Err("SETITEM(S) on other than a dict".into()),
                }
                self.check(self.top_item()?)?;
            }
            b'a' | b'e' => {
                let items = if op == b'a' {
                    vec![self.pop()?]
                } else {
                    self.pop_to_mark()?
                };
                let top = self.top()?;
                top.grow(&items);
                match &mut top.v {
                    Value::List(l) => l.extend(items.into_iter().map(|i| i.v)),
                    _ => return Err("APPEND(S) to other than a list".into()),
                }
                self.check(self.top_item()?)?;
            }
            b'0' => drop(self.pop()?),
            b'1' => drop(self.pop_to_mark()?),
            b'2' => {
                let item = self.top()?.clone();
                self.charge(item.nodes)?;
                self.stack.push(Slot::Value(item));
            }
            _ => return Err("not an opcode torch.save writes".into()),
        }
        Ok(())
    }

    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or("the pickle ends early")?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("took N bytes"))
    }

    /// A text line (GLOBAL's module and name), without its newline.
    fn line(&mut self) -> Result<String, String> {
        let rest = &self.bytes[self.at..];
        let n = rest
            .iter()
            .take(1024)
            .position(|&b| b == b'\n')
            .ok_or("a GLOBAL name without its newline")?;
        let s = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.at += n + 1;
        Ok(s)
    }

    fn charge(&mut self, nodes: usize) -> Result<(), String> {
        self.nodes = self.nodes.saturating_add(nodes);
        if self.nodes > MAX_NODES {
            return Err(format!("more than {MAX_NODES} values"));
        }
        Ok(())
    }

    fn check(&self, item: &Item) -> Result<(), String> {
        if item.depth > MAX_DEPTH {
            return Err(format!("values nested more than {MAX_DEPTH} deep"));
        }
        Ok(())
    }

    fn leaf(&mut self, v: Value) -> Result<(), String> {
        self.push(Item::leaf(v))
    }

    /// Pushes a new value (its parts were charged when they were pushed).
    fn push(&mut self, item: Item) -> Result<(), String> {
        self.charge(1)?;
        self.check(&item)?;
        self.stack.push(Slot::Value(item));
        Ok(())
    }

    fn put(&mut self, k: u32) -> Result<(), String> {
        let item = self.top_item()?.clone();
        if self.memo.len() >= MAX_NODES {
            return Err("too many memo entries".into());
        }
        self.memo.insert(k, item);
        Ok(())
    }

    fn pop(&mut self) -> Result<Item, String> {
        match self.stack.pop() {
            Some(Slot::Value(v)) => Ok(v),
            Some(Slot::Mark) => Err("a value expected, a mark found".into()),
            None => Err("the stack is empty".into()),
        }
    }

    fn top_item(&self) -> Result<&Item, String> {
        match self.stack.last() {
            Some(Slot::Value(v)) => Ok(v),
            Some(Slot::Mark) => Err("a value expected, a mark found".into()),
            None => Err("the stack is empty".into()),
        }
    }

    fn top(&mut self) -> Result<&mut Item, String> {
        match self.stack.last_mut() {
            Some(Slot::Value(v)) => Ok(v),
            Some(Slot::Mark) => Err("a value expected, a mark found".into()),
            None => Err("the stack is empty".into()),
        }
    }

    fn pop_to_mark(&mut self) -> Result<Vec<Item>, String> {
        let mut items = Vec::new();
        loop {
            match self.stack.pop() {
                Some(Slot::Value(v)) => items.push(v),
                Some(Slot::Mark) => break,
                None => return Err("no mark on the stack".into()),
            }
        }
        items.reverse();
        Ok(items)
    }
}

/// Alternate keys and values as pairs.
fn pairs(items: Vec<Value>) -> Result<Vec<(Value, Value)>, String> {
    if !items.len().is_multiple_of(2) {
        return Err("an odd number of items for a dict".into());
    }
    let mut it = items.into_iter();
    let mut out = Vec::new();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}

/// A little-endian two's-complement integer of up to eight bytes.
fn long(bytes: &[u8]) -> Result<i64, String> {
    if bytes.len() > 8 {
        return Err(format!("an integer of {} bytes", bytes.len()));
    }
    if bytes.is_empty() {
        return Ok(0);
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    let mut buf = [if negative { 0xff } else { 0 }; 8];
    buf[..bytes.len()].copy_from_slice(bytes);
    Ok(i64::from_le_bytes(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What Python 3.11's `pickle.dumps({"a": [1, -2, 300, 70000], "b": ("x", None, True, 1.5)},
    /// protocol=2)` writes.
    const SAMPLE: &[u8] = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01J\x70\x11\x01\x00eX\x01\x00\x00\x00bq\x03(X\x01\x00\x00\x00xq\x04N\x88G?\xf8\x00\x00\x00\x00\x00\x00tq\x05u.";

    #[test]
    fn reads_what_python_pickles() {
        let v = read(SAMPLE).unwrap();
        assert_eq!(
            v.get("a"),
            Some(&Value::List(vec![
                Value::Int(1),
                Value::Int(-2),
                Value::Int(300),
                Value::Int(70000)
            ]))
        );
        assert_eq!(
            v.get("b"),
            Some(&Value::Tuple(vec![
                Value::Str("x".into()),
                Value::None,
                Value::Bool(true),
                Value::Float(1.5)
            ]))
        );
    }

    #[test]
    fn hostile_pickles_are_errors() {
        // Every prefix of a good pickle ends early.
        for n in 0..SAMPLE.len() - 1 {
            assert!(read(&SAMPLE[..n]).is_err(), "prefix of {n} bytes");
        }
        // An opcode that runs code elsewhere (INST) is refused.
        assert!(read(b"\x80\x02(iposix\nsystem\n.").is_err());
        // A memo reference that was never put.
        assert!(read(b"\x80\x02h\x07.").is_err());
        // A value copied from the memo again and again stops at the node budget.
        let mut bomb = b"\x80\x02]q\x00".to_vec();
        for _ in 0..20 {
            bomb.extend_from_slice(b"(h\x00h\x00h\x00h\x00lq\x00");
        }
        bomb.push(b'.');
        let e = read(&bomb).unwrap_err();
        assert!(e.contains("values"), "{e}");
        // Tuples nested deeper than any torch pickle.
        let mut deep = b"\x80\x02N".to_vec();
        deep.extend(std::iter::repeat_n(0x85u8, 100_000));
        deep.push(b'.');
        let e = read(&deep).unwrap_err();
        assert!(e.contains("nested"), "{e}");
        // Integers longer than eight bytes.
        assert!(read(b"\x80\x02\x8a\x09\x01\x01\x01\x01\x01\x01\x01\x01\x01.").is_err());
    }

    #[test]
    fn long_integers_keep_their_sign() {
        assert_eq!(long(&[0xff]).unwrap(), -1);
        assert_eq!(long(&[0x00, 0x01]).unwrap(), 256);
        assert_eq!(long(&[0x00, 0x80]).unwrap(), -32768);
    }
}
