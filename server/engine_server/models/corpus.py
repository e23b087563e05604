# ruff: noqa: E501  (prose lines)
"""A small embedded text corpus for training the test tokenizer (written for this project)."""

from __future__ import annotations

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
An inference server turns a prompt into tokens, runs the model one step at a time, and streams the answer back.
Continuous batching lets new requests join the running batch at every step instead of waiting for the slowest one.
A paged key-value cache splits memory into fixed-size blocks, so a sequence grows one block at a time.
When memory runs out, the scheduler preempts the youngest request and recomputes it later.
Prefix caching reuses the blocks of a shared system prompt across many conversations.
The weather today is sunny with a light breeze from the west; tomorrow brings clouds and a chance of rain.
She opened the window, looked at the river, and wrote three lines in her notebook before breakfast.
He counted the boxes twice: twelve on the left shelf, seventeen on the right, and one hidden behind the door.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048 65536 3.14159 2.71828 -1 +1 1e-5 0x1F.
Dates and times: 2026-12-02 15:47:49 UTC, Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
Questions and answers: What is the capital of France? Paris. How many legs does a spider have? Eight.
Please summarize the following text in one sentence. Translate this paragraph into French. Write a short poem.
You are a helpful assistant. Answer briefly and accurately. If you do not know, say that you do not know.
def add(a: int, b: int) -> int:
    return a + b
for i in range(10):
    print(f"step {i}: loss={i * 0.5:.3f}")
class Scheduler:
    def __init__(self, max_num_seqs: int) -> None:
        self.waiting = deque()
        self.running = []
fn main() { let v: Vec<u32> = (0..10).collect(); println!("{:?}", v); }
func main() { fmt.Println("hello, world") }
{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 16, "temperature": 0.7, "stream": true}
<html><body><p>Hello &amp; welcome!</p></body></html>
SELECT id, name FROM users WHERE created_at > '2026-01-01' ORDER BY id LIMIT 10;
Mountains rise above the valley where farmers grow wheat, barley, apples and grapes in the long summer.
The library was quiet except for the ticking clock and the soft rustle of pages turning in the afternoon light.
Engineers measure throughput in tokens per second and latency as the time to the first token.
Small models are fast; large models are slow but know more. Tests use small models with random weights.
Bonjour tout le monde. Guten Tag, wie geht es Ihnen? Buenos dias, amigo. Ciao, come stai? Ola, tudo bem?
Unicode text: naive cafe resume - naïve café résumé, Straße, Ελληνικά, русский язык, 日本語のテキスト, 中文文本, 한국어, emoji 🙂🚀.
Once upon a time there was a small robot who wanted to learn every word in every language of the world.
Every morning the robot read one book, and every evening it wrote down the words it had learned that day.
After many years the robot had filled a thousand notebooks, and it began to teach the children of the village.
The children asked questions about stars, oceans, machines, music, numbers, animals and the history of cities.
The robot answered patiently, and when it did not know an answer, it said so and went looking for one.
Water boils at one hundred degrees Celsius at sea level and freezes at zero degrees.
The sun is a star; the earth goes around the sun once a year and turns around itself once a day.
Good software is simple, tested and measured. Errors should be clear and name the field that was wrong.
A request that is invalid is rejected before admission, and one bad request never affects the others.
"""
