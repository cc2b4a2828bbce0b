// outbox-relay console: the little the pages need from a script. Served as
// a file of its own, so the Content-Security-Policy allows no inline script.
// It never builds HTML from data: the overview's refresh swaps in the
// server's own rendering of the page, in which html/template escaped every
// value, and everything else only toggles and counts.
"use strict";

(function () {
  // The overview refreshes itself.
  var main = document.querySelector("main");
  var refresh = parseInt(document.body.dataset.refresh || "0", 10);
  if (main && refresh > 0 && document.getElementById("role")) {
    var busy = false;
    setInterval(function () {
      if (busy || document.hidden) return;
      busy = true;
      fetch(location.href, { credentials: "same-origin", cache: "no-store" })
        .then(function (r) {
          if (!r.ok) throw new Error("HTTP " + r.status);
          return r.text();
        })
        .then(function (html) {
          var doc = new DOMParser().parseFromString(html, "text/html");
          var next = doc.querySelector("main");
          if (next) main.replaceChildren.apply(main, Array.from(next.childNodes));
        })
        .catch(function () {
          var p = document.getElementById("problems");
          if (p) {
            var li = document.createElement("li");
            li.className = "error";
            li.textContent = "refresh failed; showing the last reading";
            p.replaceChildren(li);
          }
        })
        .finally(function () { busy = false; });
    }, refresh * 1000);
  }

  // The rows table: select all, and count what is ticked.
  var all = document.getElementById("select-all");
  var picked = document.getElementById("picked");
  function count() {
    var n = document.querySelectorAll("input.pick:checked").length;
    if (picked) picked.textContent = String(n);
  }
  if (all) {
    all.addEventListener("change", function () {
      document.querySelectorAll("input.pick").forEach(function (c) { c.checked = all.checked; });
      count();
    });
  }
  document.querySelectorAll("input.pick").forEach(function (c) {
    c.addEventListener("change", count);
  });
  count();
})();
