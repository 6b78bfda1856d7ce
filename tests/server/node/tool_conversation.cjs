// A multi-turn tool conversation driven by the npm `openai` package (a second client library).
// argv: BASE_URL API_KEY MODEL; env OPENAI_NODE_MODULES: the node_modules folder holding `openai`.
// Prints one JSON document: what each turn returned.
const path = require("node:path");
const { OpenAI } = require(path.join(process.env.OPENAI_NODE_MODULES, "openai"));

const [baseURL, apiKey, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 300000 });
const tools = [{
  type: "function",
  function: {
    name: "get_weather", description: "Get the current weather in a city",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
}];
const called = (id, city) => ({
  role: "assistant", content: null,
  tool_calls: [{ id, type: "function", function: { name: "get_weather", arguments: JSON.stringify({ city }) } }],
});
const messages = [
  { role: "user", content: "Weather in Paris?" }, called("call_1", "Paris"),
  { role: "tool", tool_call_id: "call_1", content: "sunny" }, { role: "assistant", content: "Sunny." },
  { role: "user", content: "Weather in Rome?" }, called("call_2", "Rome"),
  { role: "tool", tool_call_id: "call_2", content: "rain" }, { role: "assistant", content: "Rain." },
  { role: "user", content: "Weather in Oslo?" },
];

async function main() {
  const out = {};
  // turn 1, streamed: the SDK's stream helper assembles the tool call from the deltas
  const stream = client.chat.completions.stream({ model, messages, tools, temperature: 0, max_tokens: 48 });
  const streamed = await stream.finalChatCompletion();
  out.streamed = { finish_reason: streamed.choices[0].finish_reason, message: streamed.choices[0].message };
  // turn 1 again, not streamed
  const plain = await client.chat.completions.create({ model, messages, tools, temperature: 0, max_tokens: 48 });
  const message = plain.choices[0].message;
  out.plain = { finish_reason: plain.choices[0].finish_reason, message };
  // turn 2: the call's result goes back
  messages.push(message);
  for (const call of message.tool_calls || []) {
    const args = JSON.parse(call.function.arguments);
    messages.push({ role: "tool", tool_call_id: call.id, content: `snow in ${args.city}, -3 C` });
  }
  const answer = await client.chat.completions.create({ model, messages, tools, temperature: 0, max_tokens: 48 });
  out.answer = { finish_reason: answer.choices[0].finish_reason, message: answer.choices[0].message };
  // a refused request surfaces as the SDK's BadRequestError with the server's message
  try {
    await client.chat.completions.create({ model, messages: [{ role: "tool", tool_call_id: "nope", content: "x" }] });
    out.error = null;
  } catch (err) {
    out.error = { status: err.status, name: err.constructor.name, message: err.message };
  }
  console.log(JSON.stringify(out));
}

main().catch((err) => { console.error(err); process.exit(1); });
