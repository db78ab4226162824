"""A Sphinx extension of the course site (tools/build_site.py): Next and Previous walk the lessons.

The site's table of contents nests each lesson's solutions under it, so that the side bar shows
them with their lesson; Sphinx's own Next and Previous would then step from a lesson into its
solution and on. Here a lesson's Next is the next lesson and its Previous the lesson before,
whatever solutions lie between; a solution keeps its own (back to its lesson, on to the next one).
"""
SOLUTIONS = "notebooks/solutions/"


def _is_solution(docname):
    return docname.startswith(SOLUTIONS)


def _skip_solutions(app, pagename, templatename, context, doctree):
    if _is_solution(pagename):
        return
    relations = app.env.collect_relations()
    if pagename not in relations:
        return
    for key, step, accesskey, text in (("prev", 1, "P", "previous"), ("next", 2, "N", "next")):
        target = relations[pagename][step]
        if target is None or not _is_solution(target):
            continue
        while target is not None and _is_solution(target):
            target = relations[target][step]
        if target is None:
            context[key] = None
        else:
            context[key] = {"link": app.builder.get_relative_uri(pagename, target),
                            "title": app.builder.render_partial(app.env.titles[target])["title"]}
        # The relation links of the page's head (Sphinx's (page, title, access key, text)) say the same.
        context["rellinks"] = [link for link in context.get("rellinks", []) if link[2] != accesskey]
        if target is not None:
            context["rellinks"].append((target, context[key]["title"], accesskey, text))


def setup(app):
    app.connect("html-page-context", _skip_solutions)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
