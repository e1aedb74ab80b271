// inbox ui: live updates and actions without a reload. Served from this dashboard's own origin,
// which its Content-Security-Policy allows (and nothing inline).
"use strict";

(() => {
  const main = () => document.querySelector("main[data-live]");

  // The page's <main>, fetched again and swapped in: every few seconds while the tab is
  // visible, never while the user types in it.
  async function refresh(url = location.href) {
    const current = main();
    if (!current) return;
    const response = await fetch(url, { credentials: "same-origin" });
    if (!response.ok) throw new Error(`${response.status} ${await response.text()}`);
    swap(await response.text());
  }

  function swap(html) {
    const fresh = new DOMParser().parseFromString(html, "text/html").querySelector("main[data-live]");
    const current = main();
    if (fresh && current) current.replaceChildren(...fresh.childNodes);
  }

  function typing() {
    const active = document.activeElement;
    return active && main()?.contains(active) && active.matches("input, textarea, select");
  }

  const period = Number(main()?.dataset.live || 0) * 1000;
  if (period > 0) {
    setInterval(() => {
      if (document.visibilityState === "visible" && !typing()) refresh().catch(() => {});
    }, period);
    document.addEventListener("visibilitychange", () => {
      if (document.visibilityState === "visible") refresh().catch(() => {});
    });
  }

  // A filter's URL holds only the fields that are set. Actions post with fetch, and the page
  // they lead back to replaces this one's <main>.
  document.addEventListener("submit", async (event) => {
    const form = event.target;
    if (!(form instanceof HTMLFormElement)) return;
    if (form.method === "get") {
      event.preventDefault();
      const params = new URLSearchParams();
      for (const [name, value] of new FormData(form)) {
        if (String(value).trim() !== "") params.append(name, value);
      }
      const query = params.toString();
      location.assign(form.action + (query ? `?${query}` : ""));
      return;
    }
    if (form.method !== "post") return;
    event.preventDefault();
    if (form.dataset.confirm && !window.confirm(form.dataset.confirm)) return;
    const button = form.querySelector("button");
    if (button) button.disabled = true;
    try {
      const response = await fetch(form.action, {
        method: "POST",
        credentials: "same-origin",
        body: new URLSearchParams(new FormData(form)),
      });
      if (!response.ok) {
        const text = new DOMParser().parseFromString(await response.text(), "text/html").body.textContent;
        window.alert(text.trim());
        await refresh();
        return;
      }
      swap(await response.text());
    } finally {
      if (button) button.disabled = false;
    }
  });
})();
