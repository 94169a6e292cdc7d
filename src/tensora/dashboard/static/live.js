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
})();
