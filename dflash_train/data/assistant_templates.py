"""Assistant-style training prompts: request templates x topic lists, built offline and
deterministically (no sampling, no network).

The drafter has to be good at how people use an assistant (advice, explanations, how-tos, opinions,
short writing tasks: long-form prose answers), not only at chitchat. The held-out evaluation
requests in `assistant_eval_prompts.jsonl` were written separately and share no topic with these
lists (a test checks it).
"""

from __future__ import annotations

SKILLS = [  # verb phrases: "How do I {}?"
    "make a monthly budget and stick to it", "cook simple weeknight meals", "start running as a complete beginner",
    "improve my public speaking", "write a cover letter", "negotiate a higher salary", "train a puppy to sit",
    "grow tomatoes on a balcony", "learn a new language as an adult", "fall asleep faster",
    "organize a small apartment", "prepare for a job interview", "start journaling", "make friends in a new city",
    "take better photos with my phone", "learn to touch type", "keep houseplants alive", "meal prep for the week",
    "write a good resume", "start investing with a small amount of money", "improve my handwriting",
    "learn to swim as an adult", "plan a road trip", "reduce my screen time", "stay focused while studying",
    "give constructive feedback", "unclog a kitchen sink", "change a flat tire", "brew good coffee at home",
    "start a vegetable garden", "learn basic programming", "get better at chess", "memorize a speech",
    "stop procrastinating", "write a heartfelt thank-you note", "plan a birthday party on a budget",
    "clean a cast iron pan", "start meditating", "learn to draw portraits", "set realistic goals",
    "back up my computer files", "create a strong password", "start a podcast", "bake bread at home",
    "build a morning routine", "learn to play the ukulele", "reduce food waste at home", "save money for a vacation",
    "teach a child to ride a bike", "paint a room", "fix a squeaky door", "pack a suitcase efficiently",
    "train for a half marathon", "choose a good laptop", "write a short story", "read more books",
    "learn to juggle", "make pizza dough from scratch", "learn to knit", "set up a home office",
    "improve my posture", "drink more water during the day", "manage stress at work", "keep a conversation going",
    "make a good first impression", "run an effective meeting", "learn to sing in tune", "care for a succulent",
    "sharpen a kitchen knife", "study for a math exam", "get out of debt", "write a professional email",
    "declutter my wardrobe", "learn to cook rice perfectly", "stay motivated to exercise", "make a website",
    "speed up a slow computer", "take care of a rescue cat", "prepare for a long hike", "become a better listener",
]

SKILL_TEMPLATES = [
    "How do I {}?", "What's the best way to {}?", "Give me some tips to {}.",
    "I want to {}. Where should I start?", "What are common mistakes people make when they try to {}?",
    "Can you give me a step-by-step guide to {}?", "I've been struggling to {}. Any advice?",
    "Explain how to {} in simple terms.",
]

CONCEPTS = [  # noun phrases: "Explain {} to a beginner."
    "photosynthesis", "compound interest", "inflation", "the water cycle", "the immune system", "black holes",
    "machine learning", "the stock market", "supply and demand", "climate change", "the theory of evolution",
    "blockchain", "the Pythagorean theorem", "probability", "the greenhouse effect", "DNA", "democracy",
    "opportunity cost", "plate tectonics", "the placebo effect", "cognitive behavioral therapy", "credit scores",
    "recursion in programming", "the scientific method", "neural networks", "gravity", "electricity",
    "the French Revolution", "the Renaissance", "quantum computing", "cloud computing", "encryption",
    "the circulatory system", "metabolism", "sleep cycles", "the Big Bang", "the periodic table",
    "interest rates", "index funds", "the carbon cycle", "natural selection", "antibiotic resistance",
    "the Doppler effect", "special relativity", "cryptocurrency", "composting", "stoicism", "game theory",
    "the tragedy of the commons", "confirmation bias", "the Dunning-Kruger effect", "impostor syndrome",
    "mindfulness", "the circadian rhythm", "the food chain", "renewable energy", "nuclear fusion", "ocean tides",
    "the changing seasons", "volcanoes", "earthquakes", "the ozone layer", "ocean currents",
    "the electoral college", "income tax brackets", "a mortgage", "an API", "a relational database",
    "version control with git", "open source software", "operating systems", "search engines", "GPS",
    "3D printing", "the Industrial Revolution", "the Cold War", "the Silk Road", "the human brain",
    "vaccines", "the binary number system", "exchange rates",
]

CONCEPT_TEMPLATES = [
    "Explain {} to a beginner.", "What is {}, and why does it matter?",
    "Can you explain {} using a simple analogy?", "Summarize the key ideas behind {}.",
    "What are some common misconceptions about {}?", "How would you explain {} to a ten-year-old?",
    "Give me a short overview of {}.", "Why do people find {} confusing, and what's the clearest way to think about it?",
]

CHOICES = [  # things to weigh: "What are the pros and cons of {}?"
    "remote work", "electric cars", "living in a big city", "homeschooling", "a four-day work week",
    "social media", "online dating", "buying a used car", "renting instead of buying a home", "owning a cat",
    "a standing desk", "intermittent fasting", "studying abroad", "working at a startup", "freelancing",
    "public transportation", "smart home devices", "e-books", "a gap year", "open-plan offices", "credit cards",
    "rooftop solar panels", "tiny houses", "a vegetarian diet", "traveling solo", "online courses",
    "having a side hustle", "living with roommates", "cloud storage", "a mechanical keyboard",
    "video games for kids", "standardized testing", "nuclear power", "self-driving cars", "cashless payments",
    "fast fashion", "minimalist living", "early retirement", "a gym membership", "home workouts",
    "co-working spaces", "pet insurance", "moving to the countryside", "waking up at 5 am", "cold showers",
    "using a password manager", "wearing a smartwatch", "raising backyard chickens", "learning Latin",
    "buying in bulk", "meal kit subscriptions", "a long commute by train", "getting a master's degree",
    "adopting an older dog", "a capsule wardrobe", "a digital detox", "learning two languages at once",
    "hybrid cars", "group travel tours", "private health insurance", "a career in teaching", "camping holidays",
    "a shared family calendar", "open book exams", "daily stand-up meetings", "city bikes", "audiobooks",
    "a sabbatical", "working night shifts", "subscription streaming services",
]

CHOICE_TEMPLATES = [
    "What are the pros and cons of {}?", "Is {} worth it?", "What do you think about {}?",
    "Write a short paragraph about {}.", "Give me a balanced take on {}.",
    "Who is {} a good fit for, and who should avoid it?",
    "I'm considering {}. What should I think about before deciding?",
    "What are the biggest downsides of {} that people don't talk about?",
]

SITUATIONS = [  # first-person situations: "{} Any advice?"
    "My roommate never does the dishes.", "I have a job interview tomorrow and I'm really nervous.",
    "I keep putting off my thesis.", "My best friend moved away and I feel lonely.",
    "I got a bad grade on my midterm.", "My coworker takes credit for my work.",
    "I can't decide between two job offers.", "My dog barks every time someone walks past the house.",
    "I feel overwhelmed by my to-do list.", "My neighbor plays loud music late at night.",
    "I want to ask my boss for more flexible hours.", "My parents don't approve of my career choice.",
    "I'm starting a new job next week.", "My sister and I had a big argument.",
    "I spend too much money on takeout.", "I'm moving to a new country alone.",
    "I have to give a presentation to executives.", "My team missed an important deadline.",
    "I'm bored with my daily routine.", "I forgot an important anniversary.",
    "My kids fight constantly on long car rides.", "I'm afraid of speaking up in meetings.",
    "My laptop is running out of storage space.", "I have three exams in the same week.",
    "I want to go back to school at forty.", "My friend keeps canceling plans at the last minute.",
    "I was laid off yesterday.", "I'm hosting my in-laws for a whole week.",
    "I can never remember where I put my keys.", "My garden gets eaten by slugs.",
    "I feel stuck in my current job.", "I have trouble saying no to people.",
    "My partner and I disagree about how to spend money.", "I'm training for my first 10k race.",
    "My small business has few online reviews.", "I have a long layover in an unfamiliar airport.",
    "I'm planning a surprise party for my mom.", "My cat scratches the furniture.",
    "I need to write a speech for my grandfather's funeral.", "I just adopted a kitten.",
    "My manager gives vague instructions.", "I want to reconnect with an old friend.",
    "I get anxious before flying.", "I'm the new captain of my local soccer team.",
    "My teenager won't talk to me about school.",
]

SITUATION_TEMPLATES = [
    "{} Any advice?", "{} What should I do?", "{} How can I handle this better?",
    "{} Can you help me think it through?",
]

WRITING_SUBJECTS = [
    "autumn leaves", "a rainy morning in the city", "the first day of school", "an old lighthouse",
    "a cat watching birds through a window", "the smell of fresh bread", "a long train journey",
    "the ocean at night", "a forgotten attic", "a busy market", "a snowy mountain village",
    "the last day of summer", "a grandmother's kitchen", "a robot learning to paint", "a lost umbrella",
    "a thunderstorm", "a quiet library", "a campfire under the stars", "a city waking up", "friendship",
    "moving to a new home", "a garden in spring", "a retired sailor", "the moon", "a bicycle ride",
    "a small coffee shop", "an empty playground", "the first snowfall", "a street musician",
    "a time traveler", "the desert at noon", "a fox in the snow", "a message in a bottle",
    "an old photograph", "a lighthouse keeper's last night", "a kite on a windy day", "a night bus",
    "a dragon who is afraid of heights", "a sunrise over the mountains", "an abandoned amusement park",
    "a family road trip", "a village bakery", "a clock that runs backwards", "a whale song", "homesickness",
]

WRITING_TEMPLATES = [
    "Write a short poem about {}.", "Write a haiku about {}.", "Write the opening of a short story about {}.",
    "Write a short blog post introduction about {}.", "Write a few vivid sentences describing {}.",
]

COMPARISONS = [
    ("weather", "climate"), ("a virus", "bacteria"), ("baking soda", "baking powder"),
    ("a crocodile", "an alligator"), ("Python", "JavaScript"), ("a laptop", "a desktop computer"),
    ("stocks", "bonds"), ("yoga", "pilates"), ("green tea", "black tea"), ("Android", "iOS"),
    ("a debit card", "a credit card"), ("interval training", "steady cardio"), ("RAM", "disk storage"),
    ("a latte", "a cappuccino"), ("a hurricane", "a tornado"), ("empathy", "sympathy"),
    ("affect", "effect"), ("a psychologist", "a psychiatrist"), ("a comet", "an asteroid"),
    ("Wi-Fi", "Ethernet"), ("an e-reader", "a paper book"), ("LED bulbs", "incandescent bulbs"),
    ("a rabbit", "a hare"), ("leasing a car", "buying a car"), ("speed", "velocity"), ("mass", "weight"),
    ("a simile", "a metaphor"), ("a hypothesis", "a theory"), ("frozen vegetables", "fresh vegetables"),
    ("an SSD", "a hard disk drive"), ("nuclear fission", "nuclear fusion"), ("latitude", "longitude"),
    ("an ocean", "a sea"), ("butter", "margarine"), ("an acoustic guitar", "an electric guitar"),
    ("public schools", "private schools"), ("a resume", "a CV"), ("a lake", "a pond"),
    ("a town", "a city"), ("a sprain", "a strain"),
]

COMPARISON_TEMPLATES = [
    "What's the difference between {} and {}?", "How can I tell {} and {} apart?",
    "Explain {} versus {} in plain language.",
]

STYLE_SUFFIXES = [
    " Keep it under 150 words.", " Please use bullet points.", " Explain it like I'm new to this.",
    " Be concise.", " Include a concrete example.", " I'd appreciate a detailed answer.",
]


def _fill(templates: list[str], topics: list) -> list[str]:
    out = []
    for topic in topics:
        args = topic if isinstance(topic, tuple) else (topic,)
        out.extend(t.format(*args) for t in templates)
    return out


def assistant_training_prompts() -> list[str]:
    """All training prompts, in a fixed order: every template x topic, plus for advice-like
    categories one style-suffixed variant each (suffix chosen by position, so deterministic)."""
    advice = (_fill(SKILL_TEMPLATES, SKILLS) + _fill(CONCEPT_TEMPLATES, CONCEPTS)
              + _fill(CHOICE_TEMPLATES, CHOICES) + _fill(SITUATION_TEMPLATES, SITUATIONS)
              + _fill(COMPARISON_TEMPLATES, COMPARISONS))
    styled = [p + STYLE_SUFFIXES[i % len(STYLE_SUFFIXES)] for i, p in enumerate(advice)]
    return advice + _fill(WRITING_TEMPLATES, WRITING_SUBJECTS) + styled


def topic_phrases() -> list[str]:
    """Every topic phrase used above (for the held-out disjointness check)."""
    pairs = [x for pair in COMPARISONS for x in pair]
    return SKILLS + CONCEPTS + CHOICES + SITUATIONS + WRITING_SUBJECTS + pairs
