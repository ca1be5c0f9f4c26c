"""The paraphrase set: short memories of the kinds an agent keeps, each asked about by a
question that shares no content word with it, and questions nothing here answers.

Written for this repository (issue 23). ``benchmarks/paraphrase.py`` measures recall on it;
``tests/test_paraphrase_set.py`` checks that no question shares a content word (a stem, the
lexical leg's stop words aside) with its memory.
"""

from __future__ import annotations

# (memory, question): kinds are decisions, preferences, people, schedules and incidents.
PAIRS: tuple[tuple[str, str], ...] = (
    # decisions
    (
        "We decided to move the billing service from MySQL to PostgreSQL next quarter.",
        "Which database will the payments system switch to?",
    ),
    (
        "We chose React over Vue for the dashboard because the team already knows it.",
        "Why did we pick that JavaScript framework for the admin panel?",
    ),
    (
        "We agreed to freeze new features two weeks before the release.",
        "When does development of additions stop ahead of shipping?",
    ),
    (
        "We decided against Kubernetes and will keep deploying with plain virtual machines.",
        "Did we adopt container orchestration for hosting?",
    ),
    (
        "We settled on semantic versioning and a changelog entry for every pull request.",
        "How do we number releases and document changes?",
    ),
    (
        "We will hire two more support engineers before the holiday season.",
        "Is the customer help team growing?",
    ),
    (
        "We store secrets in Vault and never in environment variables.",
        "Where do passwords and tokens live?",
    ),
    (
        "We picked Stripe as the payment provider because of its fees in Europe.",
        "Why was that card processing company chosen?",
    ),
    (
        "We retired the old monolith and moved every endpoint to the new services.",
        "Is the legacy single application still running?",
    ),
    (
        "We use tabs for indentation in Go files and four spaces in Python.",
        "What whitespace convention does the codebase follow?",
    ),
    (
        "The mobile app must support Android 10 and above.",
        "What is the oldest phone OS version we still handle?",
    ),
    # preferences
    (
        "Priya prefers tea without sugar in the mornings.",
        "How does she like her hot drink early in the day?",
    ),
    (
        "The user likes dark mode in every editor.",
        "What colour scheme does he want for code tools?",
    ),
    (
        "Tom prefers email over phone calls for anything non-urgent.",
        "How does he like to be contacted about routine matters?",
    ),
    (
        "The user wants answers short, with code examples rather than long explanations.",
        "What style of reply does he favour?",
    ),
    (
        "The user runs Linux at home and a Mac at work.",
        "Which operating systems does he have on his computers?",
    ),
    (
        "Ana prefers window seats on long flights.",
        "Where does she like to sit on a plane?",
    ),
    (
        "The user doesn't want notifications after 8 pm.",
        "When should alerts stay quiet?",
    ),
    (
        "Leo's favourite band is Radiohead and he plays guitar.",
        "What music does he enjoy, and which instrument?",
    ),
    (
        "Kai is vegetarian but eats fish.",
        "What is his diet like?",
    ),
    (
        "Alice is allergic to peanuts.",
        "Which food must she avoid for medical reasons?",
    ),
    # people
    (
        "Marco is our new frontend engineer; he joined from a design agency.",
        "Who recently started working on the user interface code?",
    ),
    (
        "My sister Lena lives in Lisbon and works as a nurse.",
        "Which city is my sibling in, and what is her job?",
    ),
    (
        "Sam is the on-call contact for the search cluster this week.",
        "Who should be paged if the indexing servers break?",
    ),
    (
        "Jenna manages the data science group and reports to the CTO.",
        "Who leads the analytics team, and who is her boss?",
    ),
    (
        "Nora is my manager; our one-to-one is on Wednesdays.",
        "When do I meet privately with my boss?",
    ),
    (
        "Ravi speaks Hindi, Tamil and English.",
        "Which languages does he know?",
    ),
    (
        "Elena is the best person to ask about tax rules in Spain.",
        "Who knows Spanish fiscal regulations?",
    ),
    (
        "Grandma's birthday is on 14 May; she loves lilies.",
        "Which day is my nan's party, and what bouquet would please her?",
    ),
    (
        "The cat sleeps on the warm windowsill every afternoon.",
        "where does the pet nap",
    ),
    (
        "The neighbours' dog barks all night when they are away.",
        "What noise keeps me awake when the people next door travel?",
    ),
    # schedules
    (
        "Standup meeting is at 9:30 every weekday in room B.",
        "When is the daily team sync held?",
    ),
    (
        "The quarterly report is due to the board on the first Friday of March.",
        "When must the three-month summary reach the directors?",
    ),
    (
        "Dentist appointment on Thursday at 3 pm.",
        "When is my teeth checkup?",
    ),
    (
        "Backups run nightly at 2 am and are kept for thirty days.",
        "How often do we save copies of our data, and how long do we retain them?",
    ),
    (
        "The team lunch is every second Friday at the Thai place on Main Street.",
        "When do colleagues eat together, and where?",
    ),
    (
        "Rent of 1,450 euros is paid on the first of each month.",
        "How much do I owe the landlord, and when?",
    ),
    (
        "The vendor contract with Acme renews automatically in September unless cancelled by July.",
        "By when must we give notice to stop the supplier agreement from extending?",
    ),
    (
        "The flight to Berlin leaves at 7:10 from gate 22 on Sunday.",
        "When does my plane to Germany depart?",
    ),
    (
        "The project deadline moved from June to the end of August.",
        "Has the delivery date for our work been pushed back?",
    ),
    (
        "Gym sessions are Monday, Wednesday and Friday before breakfast.",
        "When do I exercise?",
    ),
    (
        "Parent-teacher evening is on 3 October at 6 pm.",
        "When do I see my child's school staff?",
    ),
    (
        "Design review happens on the last Thursday of each month.",
        "When do we critique mockups together?",
    ),
    (
        "My car's MOT inspection is due in November.",
        "When does the vehicle need its annual roadworthiness test?",
    ),
    (
        "The interns start on 1 July and stay until the end of September.",
        "When are the summer trainees with us?",
    ),
    (
        "Piano lessons for Mia are on Saturday mornings.",
        "When is my daughter's music class?",
    ),
    (
        "Weekly groceries are delivered on Tuesday evenings.",
        "When does the food shopping arrive?",
    ),
    # incidents
    (
        "The production database ran out of disk space on Tuesday night and writes failed.",
        "What outage happened when storage filled up?",
    ),
    (
        "The API gateway crashed after a bad config push and was rolled back within minutes.",
        "What happened when a faulty settings deploy broke the entry proxy?",
    ),
    (
        "Payment processing failed for two hours because an expired TLS certificate was not "
        "renewed.",
        "Why could shoppers not check out for a while?",
    ),
    (
        "The laptop battery swelled and the machine was sent back for repair.",
        "Why was my notebook computer returned to the manufacturer?",
    ),
    (
        "Staging was wiped by a cleanup script that matched the wrong prefix.",
        "How did the test environment lose everything?",
    ),
    (
        "Our cloud bill doubled last month because of an unused GPU instance left running.",
        "Why did hosting costs spike recently?",
    ),
    (
        "The login page was down for an hour after the identity provider changed its keys.",
        "Why couldn't people sign in earlier?",
    ),
    (
        "A memory leak in the image resizer restarted workers every few hours.",
        "Why did the thumbnail service keep rebooting?",
    ),
    (
        "The support queue had a backlog of 400 tickets after the newsletter went out.",
        "Why were help requests piling up?",
    ),
    (
        "The water heater leaked and flooded the basement on Sunday.",
        "What plumbing trouble damaged the cellar?",
    ),
    (
        "The CI pipeline got slow because the cache key changed and nothing was reused.",
        "Why did the build jobs take longer?",
    ),
    (
        "Coffee machine on the third floor is broken; use the one in the kitchen.",
        "Where can I get an espresso today?",
    ),
)

# Questions nothing above answers.
UNRELATED: tuple[str, ...] = (
    "banana smoothie recipe",
    "What is the capital of Australia?",
    "How do volcanoes form?",
    "Best way to grow tomatoes on a balcony",
    "Who won the 1998 football World Cup?",
    "How many moons does Jupiter have?",
    "recipe for sourdough bread",
    "how do bees make honey",
    "what is the boiling point of mercury",
    "history of the Roman empire",
    "how to knit a scarf",
    "rules of cricket",
    "distance from the earth to the sun",
    "symptoms of vitamin D deficiency",
    "how does a jet engine work",
    "best hiking trails in Patagonia",
    "how to tune a violin",
    "origin of the Olympic games",
    "what do pandas eat",
    "how to remove a red wine stain",
    "chess opening strategies",
    "photosynthesis explained",
    "why is the sky blue",
    "largest desert in the world",
)
