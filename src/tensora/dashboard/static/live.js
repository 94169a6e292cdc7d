// The dashboard's only script, and it is optional: pages read fine without it.
// 1. [data-live="URL"]: the element's content is refreshed from URL every two seconds.
// 2. form[data-confirm="TEXT"]: submitted only once TEXT is confirmed (Delete: a notebook's files go).
// 3. The create form: a CPU warning shows as soon as any chosen class is a CPU one (what a CPU class asked for
//    means, or that CPU fallback is enabled), and only
//    the fieldsets of the chosen kind show.
"use strict";
(function () {
  for (const el of document.querySelectorAll("[data-live]")) {
    let busy = false;
    setInterval(async function () {
      if (busy || document.hidden) return;
      busy = true;
      try {
        const r = await fetch(el.dataset.live, { credentials: "same-origin", headers: { "Accept": "text/html" } });
        if (r.status === 401) { window.location = "/login"; return; }
        if (r.ok) {
          const html = await r.text();
          if (html !== el.dataset.last) { el.innerHTML = html; el.dataset.last = html; }
        }
      } catch (e) { /* the server is away for a moment: try again next time */ }
      finally { busy = false; }
    }, 2000);
  }

  for (const f of document.querySelectorAll("form[data-confirm]")) {
    f.addEventListener("submit", function (ev) { if (!window.confirm(f.dataset.confirm)) ev.preventDefault(); });
  }

  const form = document.getElementById("create");
  if (!form) return;
  const warning = document.getElementById("cpu-warning");
  const kind = document.getElementById("kind");
  const asked = document.getElementById("gpu_class");
  function isCpu(s) {
    const opt = s.options[s.selectedIndex];
    return Boolean(opt && opt.hasAttribute("data-cpu"));
  }
  function update() {
    // a CPU class asked for is what was chosen, not a fallback; a CPU fallback of a GPU class is one
    const fallback = Array.from(form.querySelectorAll("select[data-class]")).some(function (s) {
      return s !== asked && isCpu(s);
    });
    if (isCpu(asked)) warning.textContent = warning.dataset.requested.replace("{cls}", asked.value);
    else if (fallback) warning.textContent = warning.dataset.fallback;
    warning.hidden = !(isCpu(asked) || fallback);
    for (const fs of form.querySelectorAll("fieldset[data-kind]")) fs.hidden = fs.dataset.kind !== kind.value;
  }
  form.addEventListener("change", update);
  update();

  // the obvious checks, by the server's rules and in its words (data-* of the form), every field at once;
  // the server makes them again, and the API the rest
  function seconds(text) {
    const t = text.trim().toLowerCase().replace(/ /g, "");
    if (/^\d+(\.\d+)?$/.test(t)) return parseFloat(t);
    const units = { ms: 0.001, s: 1, m: 60, h: 3600, d: 86400 };
    const part = /(\d+(?:\.\d+)?)(ms|s|m|h|d)/y;
    let total = 0, m;
    part.lastIndex = 0;
    while (part.lastIndex < t.length && (m = part.exec(t)) !== null) total += parseFloat(m[1]) * units[m[2]];
    return t && part.lastIndex === t.length ? total : NaN;
  }
  function flag(input, message) {
    const id = input.id + "-error";
    let p = document.getElementById(id);
    if (!message) {
      input.removeAttribute("aria-invalid");
      if (p) p.remove();
      return false;
    }
    input.setAttribute("aria-invalid", "true");
    if (!p) {
      p = document.createElement("p");
      p.id = id; p.className = "error field-error"; p.setAttribute("role", "alert");
      input.insertAdjacentElement("afterend", p);
    }
    p.textContent = message;
    return true;
  }
  form.addEventListener("submit", function (ev) {
    const name = document.getElementById("name"), after = document.getElementById("fallback_after");
    const badName = !new RegExp(form.dataset.namePattern).test(name.value.trim());
    const s = after.value.trim() ? seconds(after.value) : 0;
    const badAfter = !(s >= 0 && s <= Number(form.dataset.afterMaxS));
    const bad = [flag(name, badName ? form.dataset.nameError : ""), flag(after, badAfter ? form.dataset.afterError : "")];
    if (bad.some(Boolean)) {
      ev.preventDefault();
      (badName ? name : after).focus();
    }
  });
})();
