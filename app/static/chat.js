// The playground's chat mode: a conversation (an optional system prompt, the user's turns, the assistant's replies)
// streamed from POST /v1/chat/completions (OpenAI's chunks: the role, then the content token by token with its
// logprobs, the finish_reason, the usage, [DONE]), each reply token coloured by its probability by the same code
// as the completion mode's. playground.html owns the page, the shared controls and helpers (window.FolioPage) and
// calls FolioChat.send() and FolioChat.clear(); the conversation itself lives here.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const page = window.FolioPage;
  const TOP_LOGPROBS = 5;  // alternatives per token, shown in its tooltip
  let turns = [];  // the conversation so far, as sent: {role, content}; the system prompt is read at each send

  function bubble(role, text = "") {
    const turn = document.createElement("div");
    turn.className = `msg ${role}`;
    const who = document.createElement("div");
    who.className = "role"; who.textContent = role;
    const content = document.createElement("div");
    content.className = "content"; content.textContent = text;
    turn.append(who, content);
    $("conversation").append(turn);
    return turn;
  }

  // the conversation scrolled to its end, once a frame: reading its height lays the page out, and a fast stream
  // brings many tokens a frame (laid out after each one, 4000 tokens took the page 40 s)
  let scrolling = false;
  function scrollDown() {
    if (scrolling) return;
    scrolling = true;
    requestAnimationFrame(() => {
      scrolling = false;
      const log = $("conversation");
      log.scrollTop = log.scrollHeight;
    });
  }

  // a token's tooltip: its probability and the alternatives the server sent
  function title(entry) {
    const alts = entry.top_logprobs.map((a) => `${JSON.stringify(a.token)} ${Math.exp(a.logprob).toFixed(3)}`);
    return `p = ${Math.exp(entry.logprob).toFixed(3)}` + (alts.length ? ` · alternatives ${alts.join(", ")}` : "");
  }

  function requestBody(messages) {
    const c = page.controls();
    return page.withSeed({
      messages, max_completion_tokens: c.maxTokens, ...(c.greedy ? { temperature: 0 } : page.samplingFields()),
      logprobs: true, top_logprobs: TOP_LOGPROBS, stream: true, stream_options: { include_usage: true } });
  }

  // how full the model's context is: a conversation past it cannot go on (the next prompt is refused)
  function fill(usage) {
    const block = page.info()?.block_size, total = usage.total_tokens;
    if (!block) return `conversation ${total} tokens`;
    return total <= block ? `conversation ${total} of ${block} tokens`
                          : `conversation ${total} tokens, past the context of ${block}: Clear conversation to go on`;
  }

  function summary(count, finish, usage, t0) {
    const seed = $("seed").value.trim();
    return `${count} tokens · ${finish ?? "no finish_reason"} · ` + (usage ? `${fill(usage)} · ` : "") +
      (seed ? `seed ${seed} · ` : "") + page.tokensPerSecond(count, t0);
  }

  async function send() {
    const input = $("user_input"), text = input.value;
    if (!text.trim()) {
      page.say("your message: type something to send", true); page.markInvalid("user_input");
      return;
    }
    page.clearNotes();
    const system = $("system").value;
    const messages = [...(system.trim() ? [{ role: "system", content: system }] : []), ...turns,
                      { role: "user", content: text }];
    let body;
    try { body = requestBody(messages); } catch (e) {
      if (!(e instanceof page.InputError)) throw e;
      page.fail(e);
      return;
    }
    page.say("");
    const asked = bubble("user", text), reply = bubble("assistant");
    reply.classList.add("pending");
    const content = reply.querySelector(".content");
    input.value = "";
    scrollDown();
    const { key, headers } = page.authHeaders();
    const signal = page.begin();
    let count = 0, said = "", finish = null, usage = null; const t0 = performance.now();
    try {
      const resp = await fetch("/v1/chat/completions", { method: "POST", headers, body, signal });
      if (!resp.ok) throw await page.refusal(resp, key);
      $("api_key").removeAttribute("aria-invalid");
      await page.readEvents(resp, (data) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw page.apiError(null, chunk);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices) {
          const piece = choice.delta.content ?? "";
          // one token a chunk; its text is the delta's (a token that ends inside a character adds none)
          for (const entry of choice.logprobs?.content ?? []) {
            content.append(page.tokenSpan(piece, entry.logprob, title(entry)));
            count++;
          }
          if (!choice.logprobs && piece) content.append(piece);
          said += piece;
          finish = choice.finish_reason ?? finish;
        }
        scrollDown();
      });
      turns.push({ role: "user", content: text }, { role: "assistant", content: said });
      page.say(summary(count, finish, usage, t0));
    } catch (e) {
      if (e.name === "AbortError" && count > 0) {  // what came is kept as the reply
        turns.push({ role: "user", content: text }, { role: "assistant", content: said });
        page.say(`stopped after ${count} tokens`);
      } else {  // the turn is taken back, its text put back in the box to send again
        asked.remove(); reply.remove();
        if (!input.value) input.value = text;
        if (e.name === "AbortError") page.say("stopped before a token came");
        else page.fail(e);
      }
    } finally {
      reply.classList.remove("pending");
      page.end();
    }
  }

  function clear() {
    turns = [];
    $("conversation").replaceChildren();
    page.say("");
    $("user_input").focus();
  }

  // the conversation as the next request sends it (without the system prompt), for a look from the console
  window.FolioChat = { send, clear, turns: () => turns.map((t) => ({ ...t })) };
})();
