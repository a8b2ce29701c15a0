// Markdown of model replies rendered as DOM nodes. Model output is untrusted: every piece of its text goes
// into the page through textContent or text nodes, never innerHTML, so markup in a reply (<script>,
// <img onerror>) is shown as text. Links stay text too (no javascript: URLs). Hand-written because the page
// must work offline without a build step: a markdown library would be a vendored file plus a sanitizer.
"use strict";
(function (global) {
  // `code`, **strong**, *em* (underscores are left alone: they are common inside identifiers)
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*/g;

  function inline(text, parent) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      let node;
      if (m[1]) { node = document.createElement("code"); node.textContent = m[2]; }
      else if (m[3]) { node = document.createElement("strong"); node.textContent = m[3]; }
      else { node = document.createElement("em"); node.textContent = m[4]; }
      parent.appendChild(node);
      last = m.index + m[0].length;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  function lines(text, parent) {   // a paragraph's lines, with line breaks kept
    text.split("\n").forEach((line, i) => {
      if (i) parent.appendChild(document.createElement("br"));
      inline(line, parent);
    });
  }

  function renderMarkdown(text, target) {
    target.replaceChildren();
    const src = text.split("\n");
    let para = [], list = null;
    const flush = () => {
      if (para.length) { const p = document.createElement("p"); lines(para.join("\n"), p); target.appendChild(p); }
      para = [];
    };
    for (let i = 0; i < src.length; i++) {
      const line = src[i];
      const fence = line.match(/^\s*```\s*([\w+-]*)/);
      if (fence) {
        flush(); list = null;
        const body = [];
        for (i++; i < src.length && !/^\s*```/.test(src[i]); i++) body.push(src[i]);
        const pre = document.createElement("pre"), code = document.createElement("code");
        if (fence[1]) code.dataset.lang = fence[1];
        code.textContent = body.join("\n");
        pre.appendChild(code);
        target.appendChild(pre);
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      const bullet = line.match(/^\s*(?:[-*+]|(\d+)[.)])\s+(.*)$/);
      if (heading) {
        flush(); list = null;
        const h = document.createElement("h" + Math.min(6, heading[1].length + 2));
        inline(heading[2], h);
        target.appendChild(h);
      } else if (bullet) {
        flush();
        const kind = bullet[1] ? "OL" : "UL";
        if (!list || list.tagName !== kind) { list = document.createElement(kind); target.appendChild(list); }
        const li = document.createElement("li");
        inline(bullet[2], li);
        list.appendChild(li);
      } else if (!line.trim()) {
        flush(); list = null;
      } else {
        list = null;
        para.push(line);
      }
    }
    flush();
    return target;
  }

  global.renderMarkdown = renderMarkdown;
})(window);
