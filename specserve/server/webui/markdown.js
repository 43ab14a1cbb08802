"use strict";
// A small Markdown renderer for chat replies: headings, paragraphs, lists, quotes, tables,
// fenced code, inline code, bold, italics, strike-through and http(s) links.
//
// Safe by construction: every character of the source reaches the page through esc() (and
// a link's address only when it is http(s) or mailto), never as markup of its own.
// Every run of text is split by where its characters came from (origin[i] = k: names[k]
// proposed it as an accepted draft token; 0: the model's own token), so the page can shade
// the text that speculation supplied, inside code blocks and tables too.

const Markdown = (() => {
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const esc = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);
  const slug = (name) => name.toLowerCase().replace(/[^a-z0-9-]/g, "-");

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+/;
  const RULE = /^ {0,3}([-*_])( *\1){2,} *$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^( *)([-*+]|\d{1,9}[.)]) +/;
  const TABLE_RULE = /^ *\|? *:?-+:? *(\| *:?-+:? *)*\|? *$/;
  const ESCAPABLE = /[\\`*_{}[\]()#+\-.!|~<>]/;
  const SAFE_URL = /^(https?:\/\/|mailto:)[^\s]*$/i;

  // src, with origin (an array of small ints per character, or null) and names (the type
  // named by each origin) -> HTML
  function render(src, origin, names) {
    const ctx = { src, origin, names: names || [] };
    const lines = [];
    let start = 0;
    for (const text of src.split("\n")) {
      lines.push({ text, start });
      start += text.length + 1;
    }
    return blocks(ctx, lines);
  }

  // src[a:b] as escaped text, each run of one origin in its own span
  function text(ctx, a, b) {
    const { src, origin, names } = ctx;
    if (!origin) return esc(src.slice(a, b));
    let html = "";
    for (let i = a; i < b; ) {
      const k = origin[i] || 0;
      let j = i + 1;
      while (j < b && (origin[j] || 0) === k) j++;
      const piece = esc(src.slice(i, j));
      const name = names[k] || "";
      html += k
        ? `<span class="d d-${slug(name)}" title="drafted by ${esc(name)}">${piece}</span>`
        : piece;
      i = j;
    }
    return html;
  }

  const startsTable = (lines, i) =>
    i + 1 < lines.length && lines[i].text.includes("|") && TABLE_RULE.test(lines[i + 1].text);
  const startsBlock = (lines, i) =>
    [FENCE, HEADING, RULE, QUOTE, ITEM].some((re) => re.test(lines[i].text)) ||
    startsTable(lines, i);

  function blocks(ctx, lines) {
    let html = "";
    let i = 0;
    while (i < lines.length) {
      const { text: line, start } = lines[i];
      let m;
      if (!line.trim()) {
        i++;
      } else if ((m = FENCE.exec(line))) {
        const [code, next] = fence(ctx, lines, i, m);
        html += code;
        i = next;
      } else if ((m = HEADING.exec(line))) {
        const n = m[1].length;
        html += `<h${n}>${inline(ctx, start + m[0].length, start + line.length)}</h${n}>`;
        i++;
      } else if (RULE.test(line)) {
        html += "<hr>";
        i++;
      } else if (QUOTE.test(line)) {
        const inner = [];
        for (; i < lines.length && QUOTE.test(lines[i].text); i++) {
          const cut = QUOTE.exec(lines[i].text)[0].length;
          inner.push({ text: lines[i].text.slice(cut), start: lines[i].start + cut });
        }
        html += `<blockquote>${blocks(ctx, inner)}</blockquote>`;
      } else if (ITEM.test(line)) {
        const [list, next] = items(ctx, lines, i);
        html += list;
        i = next;
      } else if (startsTable(lines, i)) {
        const [table, next] = tableOf(ctx, lines, i);
        html += table;
        i = next;
      } else {
        const parts = [];
        for (; i < lines.length && lines[i].text.trim(); i++) {
          if (parts.length && startsBlock(lines, i)) break;
          parts.push(inline(ctx, lines[i].start, lines[i].start + lines[i].text.length));
        }
        html += `<p>${parts.join("<br>")}</p>`;
      }
    }
    return html;
  }

  // a fenced code block from lines[i] to its closing fence (or the end, while it streams)
  function fence(ctx, lines, i, m) {
    const mark = m[1];
    const closing = new RegExp(`^ {0,3}${mark[0] === "`" ? "`" : "~"}{${mark.length},}\\s*$`);
    let j = i + 1;
    while (j < lines.length && !closing.test(lines[j].text)) j++;
    const last = lines[j - 1];
    const body = j > i + 1 ? text(ctx, lines[i + 1].start, last.start + last.text.length) : "";
    const lang = m[2] ? `<span class="lang">${esc(m[2])}</span>` : "";
    const html = `<div class="code">${lang}<button class="copy" type="button">copy</button><pre><code>${body}</code></pre></div>`;
    return [html, Math.min(j + 1, lines.length)];
  }

  // a list, its items' own markers kept; nesting by indentation (up to 4 levels)
  function items(ctx, lines, i) {
    let html = '<div class="list">';
    let open = false;
    for (; i < lines.length; i++) {
      const { text: line, start } = lines[i];
      const m = ITEM.exec(line);
      if (m) {
        if (open) html += "</div></div>";
        const level = Math.min(Math.floor(m[1].length / 2), 3);
        const mark = /\d/.test(m[2]) ? esc(m[2]) : "•";
        html += `<div class="li l${level}"><span class="mark">${mark}</span><div>`;
        html += inline(ctx, start + m[0].length, start + line.length);
        open = true;
      } else if (line.trim() && /^\s/.test(line)) {
        const cut = line.length - line.trimStart().length;
        html += "<br>" + inline(ctx, start + cut, start + line.length);
      } else if (!line.trim() && i + 1 < lines.length && ITEM.test(lines[i + 1].text)) {
        continue; // a loose list: items apart by a blank line
      } else {
        break;
      }
    }
    return [html + (open ? "</div></div>" : "") + "</div>", i];
  }

  // cells of a table row: [start, end) ranges of the source between the pipes
  function cells(line, start) {
    const out = [];
    let a = 0;
    let b = line.length;
    while (a < b && line[a] === " ") a++;
    if (line[a] === "|") a++;
    while (b > a && line[b - 1] === " ") b--;
    if (b > a && line[b - 1] === "|" && line[b - 2] !== "\\") b--;
    let from = a;
    for (let k = a; k <= b; k++) {
      if (k === b || (line[k] === "|" && line[k - 1] !== "\\")) {
        let x = from;
        let y = k;
        while (x < y && line[x] === " ") x++;
        while (y > x && line[y - 1] === " ") y--;
        out.push([start + x, start + y]);
        from = k + 1;
      }
    }
    return out;
  }

  function tableOf(ctx, lines, i) {
    const row = (tag, line) =>
      "<tr>" +
      cells(line.text, line.start)
        .map(([a, b]) => `<${tag}>${inline(ctx, a, b)}</${tag}>`)
        .join("") +
      "</tr>";
    let html = `<div class="table"><table><thead>${row("th", lines[i])}</thead><tbody>`;
    let j = i + 2;
    for (; j < lines.length && lines[j].text.includes("|") && lines[j].text.trim(); j++) {
      html += row("td", lines[j]);
    }
    return [html + "</tbody></table></div>", j];
  }

  const isWord = (c) => c !== undefined && /[\p{L}\p{N}_]/u.test(c);

  // where a span opened by `mark` at `from` closes before b (-1: it does not)
  function closing(s, mark, from, b) {
    for (let k = s.indexOf(mark, from); k >= 0 && k + mark.length <= b; k = s.indexOf(mark, k + 1)) {
      if (/\s/.test(s[k - 1])) continue; // a closer follows text
      if (mark.length === 1 && s[k + 1] === mark) {
        k++; // part of a double marker
        continue;
      }
      if (mark[0] === "_" && isWord(s[k + mark.length])) continue; // snake_case_names
      return k;
    }
    return -1;
  }

  function inline(ctx, a, b) {
    const s = ctx.src;
    let html = "";
    let run = a; // start of the literal text not yet written
    const flush = (to) => {
      if (to > run) html += text(ctx, run, to);
    };
    const wrap = (at, tag, from, to, next) => {
      flush(at);
      html += `<${tag}>${tag === "code" ? text(ctx, from, to) : inline(ctx, from, to)}</${tag}>`;
      run = next;
      return next;
    };
    for (let i = a; i < b; ) {
      const c = s[i];
      if (c === "\\" && i + 1 < b && ESCAPABLE.test(s[i + 1])) {
        flush(i);
        run = i + 1;
        i += 2;
      } else if (c === "`") {
        let n = 1;
        while (i + n < b && s[i + n] === "`") n++;
        const end = s.indexOf("`".repeat(n), i + n);
        i = end >= 0 && end + n <= b ? wrap(i, "code", i + n, end, end + n) : i + n;
      } else if (c === "*" || c === "_" || (c === "~" && s[i + 1] === "~")) {
        const mark = s[i + 1] === c ? c + c : c;
        const from = i + mark.length;
        const opens = from < b && !/\s/.test(s[from]) && !(c === "_" && isWord(s[i - 1]));
        const end = opens ? closing(s, mark, from + 1, b) : -1;
        const tag = c === "~" ? "del" : mark.length === 2 ? "strong" : "em";
        i = end > from ? wrap(i, tag, from, end, end + mark.length) : i + mark.length;
      } else if (c === "[") {
        const mid = s.indexOf("](", i + 1);
        const end = mid >= 0 ? s.indexOf(")", mid + 2) : -1;
        const url = end >= 0 && end < b ? s.slice(mid + 2, end) : "";
        if (SAFE_URL.test(url) && !s.slice(i + 1, mid).includes("\n")) {
          flush(i);
          html += `<a href="${esc(url)}" target="_blank" rel="noopener noreferrer">`;
          html += `${inline(ctx, i + 1, mid)}</a>`;
          i = run = end + 1;
        } else {
          i++;
        }
      } else {
        i++;
      }
    }
    flush(b);
    return html;
  }

  return { render, esc, slug };
})();
