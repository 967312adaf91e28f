// Bumblebot console: live updates by server-sent events (no library, no build step).
// On a conversation page (#live) the events of that conversation are appended as they come;
// elsewhere the running/waiting counters follow. Each event element carries data-at (when it
// happened, epoch seconds) and data-shown (when this page showed it).
"use strict";
(function () {
  function text(tag, cls, value) {
    var el = document.createElement(tag);
    if (cls) el.className = cls;
    el.textContent = value == null ? "" : String(value);
    return el;
  }
  function render(ev) {
    var d = ev.data || {};
    var li = document.createElement("li");
    li.className = "ev ev-" + ev.kind;
    li.dataset.seq = ev.seq;
    li.dataset.at = ev.at;
    li.dataset.kind = ev.kind;
    li.appendChild(text("span", "ev-kind", ev.kind.replace(/_/g, " ")));
    if (ev.kind === "turn_started") {
      li.appendChild(document.createTextNode("turn "));
      var a = text("a", "", d.turn);
      a.href = "/turns/" + encodeURIComponent(d.turn);
      li.appendChild(a);
      li.appendChild(document.createTextNode(": route " + d.route + " (" + d.reason + ")"));
    } else if (ev.kind === "step") {
      li.appendChild(document.createTextNode("step " + d.step + (d.finish_reason ? " · " + d.finish_reason : "")));
      (d.tool_calls || []).forEach(function (c) { li.appendChild(text("code", "call", c.name + "(" + c.arguments + ")")); });
      if (d.content) li.appendChild(text("span", "content", d.content));
    } else if (ev.kind === "tool_result") {
      li.appendChild(document.createTextNode(d.name + (d.ok ? " ok: " : " failed: ")));
      li.appendChild(text("span", "content", d.result));
    } else if (ev.kind === "said") {
      li.appendChild(text("span", "content", d.text));
    } else if (ev.kind === "turn_ended") {
      li.appendChild(document.createTextNode(d.status + " (" + d.stop + ")"));
    } else if (ev.kind === "queued") {
      li.appendChild(document.createTextNode(d.waiting + " waiting"));
    } else {
      li.appendChild(document.createTextNode((d.what || "") + (d.result ? ": " + d.result : "")));
    }
    if (d.dropped) li.appendChild(text("span", "dropped", "(" + d.dropped + " earlier events dropped)"));
    li.dataset.shown = Date.now() / 1000;
    return li;
  }
  function connect(url, onEvent) {
    if (!window.EventSource) return;
    var source = new EventSource(url);
    source.onopen = function () { document.body.dataset.live = "open"; };
    source.onerror = function () { document.body.dataset.live = "retrying"; };
    ["turn_started", "step", "tool_result", "said", "turn_ended", "queued", "paused", "resumed",
     "blocked", "unblocked", "action"].forEach(function (kind) {
      source.addEventListener(kind, function (message) {
        try { onEvent(JSON.parse(message.data)); } catch (e) { /* a malformed event is skipped */ }
      });
    });
    return source;
  }
  document.addEventListener("DOMContentLoaded", function () {
    var live = document.getElementById("live");
    if (live) {
      var key = live.dataset.conversation;
      var seen = Number(live.dataset.after || 0);
      connect("/events?conversation=" + encodeURIComponent(key) + "&after=" + seen, function (ev) {
        if (ev.seq <= seen) return;
        seen = ev.seq;
        if (ev.kind === "turn_started") live.textContent = "";
        live.appendChild(render(ev));
      });
      return;
    }
    var running = document.getElementById("running-count");
    var waiting = document.getElementById("waiting-count");
    if (running || waiting) {
      var active = {};
      connect("/events", function (ev) {
        if (ev.kind === "turn_started") active[ev.conversation] = true;
        if (ev.kind === "turn_ended") delete active[ev.conversation];
        if (running && (ev.kind === "turn_started" || ev.kind === "turn_ended")) {
          running.textContent = Math.max(Number(running.textContent) + (ev.kind === "turn_started" ? 1 : -1), 0);
        }
        if (waiting && ev.kind === "queued" && ev.data.total !== undefined) waiting.textContent = ev.data.total;
      });
    }
  });
})();
